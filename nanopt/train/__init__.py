"""Training: the loop and its step at the top, each other job in a subpackage below them.

Here: `loop` (a session run to its budget: step -> log -> eval -> checkpoint), `step` (one optimizer step),
`session` (everything built as training uses it), `state` (the counters, loader position and RNG a checkpoint
carries), `validation` (held-out loss), `shape_schedule` (batch warmup and sequence stages), `downstream` (the
in-loop downstream tasks' schedule; the tasks are nanopt.evaluate.tasks), `recompiles` and `mixture_report` (what a
session says of its recompilations and of its mixture's sources).

Subpackages: `optim` (optimizers and the LR schedule), `precision` (FP8, fp16 loss scaling, bf16 residual),
`parallel` (compile, DDP, FSDP2, activation checkpointing, CUDA graphs), `checkpoint` (the directory contract,
the DCP shards several ranks write, a session's background save and resume on any world size), `observe`
(metrics.jsonl, sinks, events, phases and cost), `health` (run health, measured, judged and replayed) and `guard`
(lock, preemption, stall, recovery, failures, the on-exit hook).

`loop.train` is the entry point; `validation.evaluate_loss` is its in-loop validation and `nanopt eval`'s held-out
loss alike. Imports nanopt.model, nanopt.data, nanopt.runtime and the contracts; never the CLI or rich (progress
goes through `observe.events.TrainObserver`).
"""
