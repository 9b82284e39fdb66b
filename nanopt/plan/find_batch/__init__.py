"""`nanopt find-batch`: the largest and the fastest micro-batch that fit, measured with real training steps.

A trial at micro-batch B runs `steps` (>= 3) real optimizer steps of the run exactly as `nanopt train` would:
same model, dtype, compile, activation checkpointing, parallelism and seq_len, with gradient accumulation 1 (the
trial's global batch is B x seq_len x world size). The optimizer state appears after the first step, so a size
that survives three steps survives training. Without --start the search starts at the memory model's prediction
(nanopt.model.memory, for this device's memory and the run's precision and compile) and steps up while sizes
fit, or down while they fail, by 25% first and by larger steps up to 2x; with --start it doubles from there. Then
it bisects between the last size that fit and the first that failed. --max-trials bounds the number of trials
(`search_complete` says whether the search closed in on its answer before it ran out).

Where a trial runs, and the trade-off (`--isolation auto` picks; see search.trials_in_process):

- One GPU without compile: every trial runs in this process. An OOM raises torch.OutOfMemoryError; the trial's
  session is dropped, the allocator's cache emptied and its peak statistics reset before the next trial. No CUDA
  context and no torch import per trial, which is most of a trial's time for a model the size of GPT-2 small.
- One process otherwise (the CPU, or compile): every trial runs in a process of its own, forked from a small
  server process that imported torch once (multiprocessing "forkserver", which never touches CUDA itself). An
  OOM, a CUDA error or a crash ends only that process; the next trial starts with an empty allocator and a fresh
  CUDA context. The parent reads the trial's measurement through a pipe, or its exit status when it died (killed
  by the operating system's OOM killer, a segfault). The cost is a new CUDA context, and with compile a new
  compilation, per trial.
- Under torchrun (WORLD_SIZE > 1) the ranks must form the same process group as training, so trials run in the
  ranks' own processes, with full cleanup between them (session deleted, gc, empty_cache, peak statistics reset,
  dynamo reset). After every trial the ranks all-reduce MIN of "fits" (`agree`), so all of them bisect
  identically. The price: an OOM on one rank while the others are inside a collective (a DDP bucket all-reduce,
  an FSDP all-gather) can leave them waiting there until the process-group timeout. To make that rare, a size
  whose peak, extrapolated linearly from two sizes that fit, exceeds the limit by more than 25% is recorded as
  "predicted OOM" without running it. On a single node, a one-process search with --gpu-memory is the safer
  question to ask.

What "fits" means: no OOM, and the trial's peak memory <= (1 - margin) x limit, where the limit is the GPU's
memory (or --gpu-memory, enforced with torch.cuda.set_per_process_memory_fraction) or, on the CPU where nothing
runs out of memory, the --max-memory bound on the trial process's peak resident set size. GPU peak = the caching
allocator's peak reserved bytes plus the CUDA context measured at the trial's start; CPU peak = the trial process's
peak RSS, which includes Python and torch themselves (a few hundred MiB, reported as `baseline_bytes`).

Modules, each one idea: `search` (options, the bisection, judging a trial, rank agreement; pure), `trials` (running
one trial in a process of its own, in this one or in the ranks), `calibration` (the memory model's prediction and
its error against the trials),
`finder` (the whole search, its report, find_batch.json and --write). Imports only nanopt.train (the session it
measures), nanopt.model, nanopt.runtime and the contracts.
"""
