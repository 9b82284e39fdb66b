"""`nanopt find-batch`: the largest and the fastest micro-batch that fit, measured with real training steps.

A trial at micro-batch B runs `steps` (>= 3) real optimizer steps of the run exactly as `nanopt train` would:
same model, dtype, compile, activation checkpointing, parallelism and seq_len, with gradient accumulation 1 (the
trial's global batch is B x seq_len x world size). The optimizer state appears after the first step, so a size
that survives three steps survives training. The search doubles B from `start` until a size fails or `maximum`
is reached, then bisects between the last size that fit and the first that failed.

Where a trial runs, and the trade-off:

- One process (the CPU or one GPU): every trial runs in a process of its own, forked from a small server process
  that imported torch once (multiprocessing "forkserver", which never touches CUDA itself). An OOM, a CUDA error
  or a crash ends only that process; the next trial starts with an empty allocator and a fresh CUDA context. The
  parent reads the trial's measurement through a pipe, or its exit status when it died (killed by the operating
  system's OOM killer, a segfault). The cost is a new CUDA context, and with compile a new compilation, per trial.
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
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt import errors
from nanopt.config import RunConfig, TrainConfig, from_dict, read_json, save_json
from nanopt.errors import ConfigError, NanoptError
from nanopt.flops import estimate_memory, flops_per_token

RESULT_FILE = "find_batch.json"
DEFAULT_MAX = 1024
MIN_STEPS = 3
POLL_S = 0.02  # how often the parent samples a CPU trial's resident memory
PREDICTED_OOM_FACTOR = 1.25  # under torchrun: skip sizes extrapolated to exceed the limit by this factor


@dataclass(frozen=True)
class FindBatchOptions:
    start: int = 1
    maximum: int = DEFAULT_MAX
    steps: int = MIN_STEPS
    margin: float = 0.05  # keep this fraction of the limit free
    gpu_memory: int | None = None  # bytes: behave as if the GPU had this much memory
    max_memory: int | None = None  # bytes, CPU only: bound on a trial process's peak resident memory
    trial_timeout_s: float = 1800.0

    def validate(self) -> None:
        checks = [("--start", self.start, self.start >= 1), ("--max", self.maximum, self.maximum >= self.start),
                  ("--steps", self.steps, self.steps >= MIN_STEPS), ("--margin", self.margin, 0 <= self.margin < 1),
                  ("--gpu-memory", self.gpu_memory, self.gpu_memory is None or self.gpu_memory > 0),
                  ("--max-memory", self.max_memory, self.max_memory is None or self.max_memory > 0),
                  ("--timeout", self.trial_timeout_s, self.trial_timeout_s > 0)]
        for option, value, ok in checks:
            if not ok:
                raise ConfigError(f"{option}: {value} is out of range",
                                  f"need --start >= 1, --max >= --start, --steps >= {MIN_STEPS}, 0 <= --margin < 1")


@dataclass
class Trial:
    micro_batch_size: int
    fits: bool
    reason: str  # fits | OOM | over limit | predicted OOM | killed by SIGKILL | crashed: ... | timed out
    peak_memory_bytes: int | None
    tokens_per_s: float | None
    mfu: float | None
    step_time_s: float | None
    grad_accum: int | None  # for the configured global batch; None where it does not divide exactly
    peak_is_lower_bound: bool = False  # the trial was stopped once over the bound: its true peak is higher
    predicted_peak_bytes: int | None = None
    peak_error: float | None = None  # (predicted - measured) / measured


# ------------------------------------------------------------------------------------------------- search


def search(fits: Callable[[int], bool], start: int = 1, maximum: int = DEFAULT_MAX) -> tuple[int, list[int]]:
    """The largest n in [1, maximum] with fits(n), for a predicate that holds up to a threshold and not above.

    Doubles from `start` until a size fails or `maximum` is reached, then bisects between the last size that
    fit and the first that failed (below `start` too, when `start` itself fails). Each size is tried once.
    Returns (the largest size that fits, or 0, and the sizes in the order they were tried).
    """
    if not 1 <= start <= maximum:
        raise ValueError(f"need 1 <= start <= maximum, got start {start}, maximum {maximum}")
    tried: list[int] = []

    def attempt(size: int) -> bool:
        tried.append(size)
        return fits(size)

    fit, size = 0, start
    while attempt(size):
        fit = size
        if size == maximum:
            return fit, tried
        size = min(2 * size, maximum)
    fail = size
    while fail - fit > 1:
        middle = (fit + fail) // 2
        if attempt(middle):
            fit = middle
        else:
            fail = middle
    return fit, tried


def agree(rt: Any, fits_local: bool) -> bool:
    """Whether a size fits on every rank: an all-reduce MIN, entered by every rank after every trial."""
    if not rt.distributed:
        return fits_local
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if fits_local else 0], dtype=torch.int32, device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def grad_accum_for(train: TrainConfig, micro_batch_size: int, seq_len: int, world_size: int) -> int | None:
    """Accumulation steps the configured global batch needs at this micro-batch; None if it does not divide."""
    accum, remainder = divmod(train.global_batch_tokens, micro_batch_size * seq_len * world_size)
    return accum if accum >= 1 and remainder == 0 else None


def trial_run(run: RunConfig, micro_batch_size: int, world_size: int) -> RunConfig:
    """The run with `micro_batch_size` and a global batch of exactly one micro-batch per rank (accumulation 1)."""
    train = dataclasses.replace(run.train, micro_batch_size=micro_batch_size,
                                global_batch_tokens=micro_batch_size * run.seq_len * world_size)
    return dataclasses.replace(run, train=train)


# ------------------------------------------------------------------------------------------ memory probes


class MemoryProbe:
    """Peak memory of one trial: the GPU allocator's peak reserved bytes plus the CUDA context, or on the CPU the
    process's peak resident set size (VmHWM, which Linux lets a process reset through /proc/self/clear_refs)."""

    def __init__(self, device: Any, gpu_memory: int | None = None) -> None:
        import torch

        self.device = device
        self.context_bytes = 0
        self.device_memory_bytes: int | None = None
        if device.type == "cuda":
            torch.cuda.init()
            free, total = torch.cuda.mem_get_info(device)
            # What the device has lost before our first tensor: the CUDA context (and any other process on it).
            self.context_bytes = max(0, total - free - torch.cuda.memory_reserved(device))
            self.device_memory_bytes = total
            if gpu_memory is not None:
                fraction = (gpu_memory - self.context_bytes) / total
                torch.cuda.set_per_process_memory_fraction(min(1.0, max(0.001, fraction)), device)

    def reset(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_rss_peak()

    def current(self) -> int:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.memory_reserved(self.device)) + self.context_bytes
        return _rss_bytes("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_reserved(self.device)) + self.context_bytes
        return _rss_bytes("VmHWM")


def _reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5": reset the peak RSS to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # elsewhere the peak is the process's, which is a fresh process per trial outside torchrun


def _rss_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


# --------------------------------------------------------------------------------------------- one trial


def measure(run: RunConfig, rt: Any, steps: int, probe: MemoryProbe) -> dict[str, Any]:
    """Run `steps` real training steps of `run` in this process and clean up; the measurement as plain data."""
    import torch

    from nanopt.metrics import peak_flops_for
    from nanopt.parallel import resolve_compile
    from nanopt.train import build_session, step

    compiled = resolve_compile(run.train.compile, rt.device)
    peak_flops, peak_source = peak_flops_for(rt.device, rt.precision)
    probe.reset()
    baseline = probe.current()
    session, status, detail, times = None, "ok", "", []
    try:
        session = build_session(run, rt, writes=False, check_data_budget=False)
        for _ in range(steps):
            started = time.perf_counter()
            step(session)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError as exc:
        status, detail = "oom", str(exc).strip().splitlines()[0][:300]
    peak = probe.peak()
    del session
    _release(rt.device, compiled)
    return {"status": status, "detail": detail, "peak_memory_bytes": peak, "baseline_bytes": baseline,
            "step_times_s": times, "device": rt.device.type, "device_name": _device_name(rt.device),
            "device_memory_bytes": probe.device_memory_bytes, "context_bytes": probe.context_bytes,
            "precision": rt.precision, "compiled": compiled, "peak_flops": peak_flops, "peak_source": peak_source}


def _release(device: Any, compiled: bool) -> None:
    """Free everything a trial held, so the next in-process trial starts from the same memory."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        _return_freed_memory()
    if compiled:
        torch._dynamo.reset()  # the next size compiles afresh, static shapes, as training would


def _return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps it otherwise), so the resident size an in-process CPU
    trial starts from does not carry the previous, larger trial's memory."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _trial_process(run: RunConfig, steps: int, gpu_memory: int | None, conn: Any, requester: int) -> None:
    """Entry point of a trial process: measure, send the result to the parent, exit."""
    from nanopt.runtime import init_runtime

    _exit_when_gone(requester)
    try:
        rt = init_runtime(run.train.precision)
        result = measure(run, rt, steps, MemoryProbe(rt.device, gpu_memory))
    except NanoptError as exc:
        result = {"status": "user_error", "kind": type(exc).__name__, "message": exc.message, "hint": exc.hint}
    except Exception as exc:  # reported as the reason this size failed; the search goes on
        last = traceback.format_exc().strip().splitlines()[-1]
        result = {"status": "error", "detail": _crash_reason(exc, last)}
    conn.send(result)
    conn.close()


def _exit_when_gone(pid: int, every_s: float = 1.0) -> None:
    """End this trial if the process that asked for it is gone (killed, preempted): an orphaned trial would
    hold the GPU for nothing until it finished."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(every_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass  # it exists, owned by another user

    threading.Thread(target=watch, name="find-batch-watchdog", daemon=True).start()


def _crash_reason(exc: BaseException, last_line: str) -> str:
    text = str(exc).lower()
    if "out of memory" in text or "cublas_status_alloc_failed" in text:
        return "oom: " + last_line[:300]
    return last_line[:300]


# ------------------------------------------------------------------------------------------ trial runners


def _report_cuda(conn: Any) -> None:
    import torch

    conn.send(torch.cuda.is_available())
    conn.close()


class ProcessTrials:
    """One process per trial (see the module docstring); on the CPU the parent also watches its memory."""

    def __init__(self, run: RunConfig, opts: FindBatchOptions) -> None:
        import multiprocessing

        self.run, self.opts = run, opts
        self.ctx = multiprocessing.get_context("forkserver")
        # Imported once in the server, so a trial starts in well under a second (never CUDA: that stays per trial).
        self.ctx.set_forkserver_preload(["__main__", "nanopt.find_batch", "nanopt.train", "nanopt.model",
                                         "nanopt.data.loader"])

    def cuda_available(self) -> bool:
        """Asked in a process forked from the server, so this one never imports torch (nor touches CUDA)."""
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=_report_cuda, args=(child_conn,), name="find-batch-device")
        process.start()
        child_conn.close()
        try:
            return bool(parent_conn.recv())
        finally:
            process.join()
            parent_conn.close()

    def __call__(self, micro_batch_size: int) -> dict[str, Any]:
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        # Not a daemon: torch.compile may start compile workers, which a daemon process may not have.
        process = self.ctx.Process(target=_trial_process, name=f"find-batch-{micro_batch_size}",
                                   args=(trial_run(self.run, micro_batch_size, 1), self.opts.steps,
                                         self.opts.gpu_memory, child_conn, os.getpid()))
        process.start()
        child_conn.close()
        try:
            return self._wait(process, parent_conn)
        finally:
            if process.is_alive():
                process.kill()
            process.join()
            parent_conn.close()

    def _wait(self, process: Any, conn: Any) -> dict[str, Any]:
        """The child's measurement; or why there is none: killed over the memory bound, timed out, died."""
        bound = _usable(self.opts.max_memory, self.opts.margin) if self.opts.max_memory else None
        deadline = time.monotonic() + self.opts.trial_timeout_s
        highest = 0
        while not conn.poll(POLL_S):
            rss = _process_rss(process.pid)
            highest = max(highest, rss)
            if bound is not None and rss > bound:  # already over: stop it before it takes the machine down
                process.kill()
                return {"status": "over_limit", "peak_memory_bytes": highest, "peak_is_lower_bound": True}
            if time.monotonic() > deadline:
                process.kill()
                return {"status": "timeout", "peak_memory_bytes": highest or None, "peak_is_lower_bound": True}
            if not process.is_alive() and not conn.poll(POLL_S):
                break
        try:
            return conn.recv()
        except EOFError:
            process.join()
            return {"status": "died", "detail": _exit_reason(process.exitcode), "peak_memory_bytes": highest or None,
                    "peak_is_lower_bound": True}


def _process_rss(pid: int) -> int:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        note = " (the operating system's out-of-memory killer?)" if name == "SIGKILL" else ""
        return f"killed by {name}{note}"
    return f"exited with status {exitcode} without a result"


class RankTrials:
    """Under torchrun: trials in this rank's process, measurements made identical on every rank."""

    def __init__(self, run: RunConfig, opts: FindBatchOptions, rt: Any) -> None:
        self.run, self.opts, self.rt = run, opts, rt
        self.probe = MemoryProbe(rt.device, opts.gpu_memory)
        self.fitted: list[tuple[int, int]] = []  # (micro-batch, peak) of sizes that fit, the same on every rank

    def __call__(self, micro_batch_size: int) -> dict[str, Any]:
        from nanopt.runtime import all_reduce_max

        limit = _limit(self.opts, self.probe.device_memory_bytes)
        predicted = _extrapolate(self.fitted, micro_batch_size)
        if predicted is not None and limit is not None and predicted > PREDICTED_OOM_FACTOR * limit:
            return {"status": "predicted_oom", "peak_memory_bytes": None, **self._facts()}
        m = measure(trial_run(self.run, micro_batch_size, self.rt.world_size), self.rt, self.opts.steps, self.probe)
        # Every rank must decide alike: the worst peak, and a size fits only if it fits everywhere.
        m["peak_memory_bytes"] = int(all_reduce_max(self.rt, float(m["peak_memory_bytes"])))
        fits_here, _ = judge(m, limit, self.opts.margin)
        m["agreed_fits"] = agree(self.rt, fits_here)
        if m["agreed_fits"]:
            self.fitted.append((micro_batch_size, m["peak_memory_bytes"]))
        return m

    def _facts(self) -> dict[str, Any]:
        from nanopt.metrics import peak_flops_for
        from nanopt.parallel import resolve_compile

        peak_flops, peak_source = peak_flops_for(self.rt.device, self.rt.precision)
        return {"device": self.rt.device.type, "device_name": _device_name(self.rt.device),
                "device_memory_bytes": self.probe.device_memory_bytes, "context_bytes": self.probe.context_bytes,
                "precision": self.rt.precision, "compiled": resolve_compile(self.run.train.compile, self.rt.device),
                "peak_flops": peak_flops, "peak_source": peak_source, "baseline_bytes": None}


def _extrapolate(fitted: list[tuple[int, int]], size: int) -> float | None:
    """Peak at `size` on the line through the two largest sizes that fit; None with fewer than two."""
    if len(fitted) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(fitted)[-2:]
    return p2 + (p2 - p1) / (b2 - b1) * (size - b2)


# ----------------------------------------------------------------------------------------------- judging


def _usable(limit: int | None, margin: float) -> int | None:
    return None if limit is None else int((1 - margin) * limit)


def _limit(opts: FindBatchOptions, device_memory_bytes: int | None) -> int | None:
    """The memory a trial may use before the margin: --gpu-memory, the GPU's memory, or (CPU) --max-memory.
    None only on a GPU before any trial has reported the device's memory."""
    if opts.gpu_memory is not None:
        return opts.gpu_memory
    if device_memory_bytes is not None:
        return device_memory_bytes
    return opts.max_memory


def judge(m: dict[str, Any], limit: int | None, margin: float) -> tuple[bool, str]:
    """(fits, reason) for one measurement against the limit less the margin."""
    status = m["status"]
    if status == "ok":
        usable = _usable(limit, margin)
        over = usable is not None and m["peak_memory_bytes"] > usable
        return (False, "over limit") if over else (True, "fits")
    reasons = {"oom": "OOM", "over_limit": "over limit", "predicted_oom": "predicted OOM (not run)",
               "timeout": "timed out"}
    if status in reasons:
        return False, reasons[status]
    detail = m.get("detail", "")
    if detail.startswith("oom: "):
        return False, "OOM"
    return False, detail if status == "died" else f"crashed: {detail}"


# ---------------------------------------------------------------------------------------------- find_batch


def find_batch(run: RunConfig, opts: FindBatchOptions, on_start: Callable[[int], None] | None = None,
               on_trial: Callable[[Trial], None] | None = None) -> dict[str, Any]:
    """Search the micro-batch sizes, save runs/NAME/find_batch.json (rank 0) and return the report (every rank)."""
    opts.validate()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # as torchrun sets it (nanopt.runtime would import torch here)
    if world > 1:
        from nanopt.runtime import init_runtime, shutdown

        rt = init_runtime(run.train.precision)
        try:
            _check_device(opts, rt.device.type == "cuda")
            report = _search(run, opts, RankTrials(run, opts, rt), world, on_start, on_trial)
        finally:
            shutdown(rt)
    else:
        if _surely_no_gpu():
            _check_device(opts, on_cuda=False)  # a missing --max-memory fails now, before any server starts
        trials = ProcessTrials(run, opts)
        _check_device(opts, trials.cuda_available())
        report = _search(run, opts, trials, world, on_start, on_trial)
    if int(os.environ.get("RANK", "0")) == 0:
        save_json(Path(run.run_dir) / RESULT_FILE, report)
        report["saved"] = str(Path(run.run_dir) / RESULT_FILE)
    return report


def _surely_no_gpu() -> bool:
    """True when this Linux or macOS machine has no GPU device node at all, so CUDA cannot be available."""
    import sys

    if sys.platform == "darwin":
        return True
    if not sys.platform.startswith("linux"):
        return False
    dev = Path("/dev")
    return not any(dev.glob("nvidia[0-9]*")) and not (dev / "kfd").exists()


def _check_device(opts: FindBatchOptions, on_cuda: bool) -> None:
    if on_cuda and opts.max_memory is not None:
        raise ConfigError("--max-memory bounds CPU trials; this machine has a CUDA GPU",
                          "use --gpu-memory (e.g. --gpu-memory 40GiB) to ask what fits on a smaller card")
    if not on_cuda and opts.gpu_memory is not None:
        raise ConfigError("--gpu-memory: no CUDA GPU here", "on the CPU bound each trial with --max-memory, "
                                                           "e.g. --max-memory 4GiB")
    if not on_cuda and opts.max_memory is None:
        raise ConfigError("on the CPU nothing runs out of memory, so nothing would stop the search",
                          "pass --max-memory, e.g. --max-memory 4GiB: the peak resident memory a trial process "
                          "may reach (Python and torch included)")


def _search(run: RunConfig, opts: FindBatchOptions, runner: Callable[[int], dict[str, Any]], world: int,
            on_start: Callable[[int], None] | None, on_trial: Callable[[Trial], None] | None) -> dict[str, Any]:
    trials: dict[int, Trial] = {}
    facts: dict[str, Any] = {}

    def fits(size: int) -> bool:
        if on_start:
            on_start(size)
        m = runner(size)
        if m["status"] == "user_error":
            raise getattr(errors, m["kind"], NanoptError)(m["message"], m["hint"])
        if "device" in m:
            facts.update({k: m[k] for k in _FACT_KEYS if k in m})
            facts.setdefault("baseline_bytes", m.get("baseline_bytes"))
        trial = _trial(run, world, size, m, facts, opts)
        trials[size] = trial
        if on_trial:
            on_trial(trial)
        return trial.fits

    max_fit, order = search(fits, opts.start, opts.maximum)
    return _report(run, opts, world, max_fit, order, trials, facts)


_FACT_KEYS = ("device", "device_name", "device_memory_bytes", "context_bytes", "precision", "compiled", "peak_flops",
              "peak_source")


def _trial(run: RunConfig, world: int, size: int, m: dict[str, Any], facts: dict[str, Any],
           opts: FindBatchOptions) -> Trial:
    fits, reason = judge(m, _limit(opts, facts.get("device_memory_bytes")), opts.margin)
    if "agreed_fits" in m and m["agreed_fits"] != fits:
        fits, reason = m["agreed_fits"], "fits" if m["agreed_fits"] else "does not fit on another rank"
    times = m.get("step_times_s") or []
    timed = times[1:] if len(times) > 1 else times  # the first step allocates the optimizer state (and compiles)
    # The fastest timed step: other work on the machine only ever slows a step down, so the minimum is the
    # steadiest estimate for comparing sizes.
    step_time = min(timed) if timed and m["status"] == "ok" else None
    tokens_per_s = size * run.seq_len * world / step_time if step_time else None
    peak_flops = facts.get("peak_flops")
    mfu = (tokens_per_s * flops_per_token(run.model, run.seq_len) / (world * peak_flops)
           if tokens_per_s and peak_flops else None)
    return Trial(micro_batch_size=size, fits=fits, reason=reason, peak_memory_bytes=m.get("peak_memory_bytes"),
                 tokens_per_s=tokens_per_s, mfu=mfu, step_time_s=step_time,
                 grad_accum=grad_accum_for(run.train, size, run.seq_len, world),
                 peak_is_lower_bound=bool(m.get("peak_is_lower_bound")))


# -------------------------------------------------------------------------------------------------- report


def _report(run: RunConfig, opts: FindBatchOptions, world: int, max_fit: int, order: list[int],
            trials: dict[int, Trial], facts: dict[str, Any]) -> dict[str, Any]:
    limit = _limit(opts, facts.get("device_memory_bytes"))
    fitting = [t for t in trials.values() if t.fits]
    exact = [t for t in fitting if t.grad_accum is not None]
    best = max(exact or fitting, key=lambda t: (t.tokens_per_s or 0.0, t.micro_batch_size), default=None)
    max_exact = max((t.micro_batch_size for t in exact), default=None)
    calibration = calibrate(run, world, facts, trials, _usable(limit, opts.margin), max_fit,
                            capped=max_fit == opts.maximum)
    configured = run.train.micro_batch_size
    return {
        "run": str(run.run_dir), "device": facts.get("device"), "device_name": facts.get("device_name"),
        "world_size": world, "precision": facts.get("precision"), "compiled": facts.get("compiled"),
        "activation_checkpointing": run.train.activation_checkpointing, "parallelism": run.train.parallelism,
        "seq_len": run.seq_len, "steps_per_trial": opts.steps,
        "limit": {"kind": "gpu" if facts.get("device") == "cuda" else "cpu_peak_rss", "bytes": limit,
                  "margin": opts.margin, "usable_bytes": _usable(limit, opts.margin),
                  "gpu_memory_cap": opts.gpu_memory, "context_bytes": facts.get("context_bytes"),
                  "baseline_bytes": facts.get("baseline_bytes")},
        "max_micro_batch": max_fit,
        "max_micro_batch_capped": max_fit == opts.maximum,  # every size up to --max fit: the true max is higher
        "best_micro_batch": best.micro_batch_size if best else None,
        "max_exact_micro_batch": max_exact,
        "global_batch_tokens": run.train.global_batch_tokens,
        "grad_accum_at_max": trials[max_fit].grad_accum if max_fit else None,
        "grad_accum_at_best": best.grad_accum if best else None,
        "configured": {"micro_batch_size": configured,
                       "grad_accum": grad_accum_for(run.train, configured, run.seq_len, world),
                       "fits": trials[configured].fits if configured in trials else None},
        "peak_flops": facts.get("peak_flops"), "peak_source": facts.get("peak_source"),
        "search_order": order,
        "trials": [dataclasses.asdict(trials[size]) for size in sorted(trials)],
        "predicted_max_micro_batch": calibration["predicted_max_micro_batch"],
        "calibration": calibration,
    }


def calibrate(run: RunConfig, world: int, facts: dict[str, Any], trials: dict[int, Trial], usable: int | None,
              max_fit: int, capped: bool) -> dict[str, Any]:
    """How far nanopt.flops.estimate_memory is from what the trials measured; fills each trial's prediction."""
    if facts.get("precision") is None:
        return {"predicted_peak_bytes": None, "measured_peak_bytes": None, "peak_error": None,
                "predicted_max_micro_batch": None, "max_micro_batch_error": None, "note": "nothing was measured"}
    model = estimate_memory(run.model, run.seq_len, precision=facts["precision"], compiled=bool(facts["compiled"]),
                            activation_checkpointing=run.train.activation_checkpointing,
                            parallelism=run.train.parallelism, world_size=world)
    on_cpu = facts.get("device") != "cuda"
    if on_cpu and facts.get("baseline_bytes"):
        # The model's runtime overhead stands for a CUDA context; a CPU process has Python and torch instead.
        model = dataclasses.replace(model, runtime_overhead=int(facts["baseline_bytes"]))
    for trial in trials.values():
        trial.predicted_peak_bytes = model.total(trial.micro_batch_size)
        if trial.peak_memory_bytes and not trial.peak_is_lower_bound:
            trial.peak_error = trial.predicted_peak_bytes / trial.peak_memory_bytes - 1
    point = _calibration_point(trials, max_fit)
    predicted_max = model.max_micro_batch(usable) if usable is not None else None
    slope = _measured_bytes_per_sequence(trials)
    note = ("CPU: peaks are the trial process's resident memory, Python and torch included; the model's runtime "
            "overhead is replaced by that measured baseline" if on_cpu else
            "GPU: peaks are the allocator's peak reserved bytes plus the CUDA context")
    return {
        "predicted_peak_bytes": point.predicted_peak_bytes if point else None,
        "measured_peak_bytes": point.peak_memory_bytes if point else None,
        "peak_error": point.peak_error if point else None,
        "at_micro_batch": point.micro_batch_size if point else None,
        "predicted_max_micro_batch": predicted_max,
        "max_micro_batch_error": predicted_max / max_fit - 1 if predicted_max is not None and max_fit and not capped
        else None,
        "predicted_bytes_per_sequence": model.activations_per_sequence,
        "measured_bytes_per_sequence": slope,
        "note": note + ("; max_micro_batch_error is not defined when every size up to --max fits" if capped else ""),
    }


def _calibration_point(trials: dict[int, Trial], max_fit: int) -> Trial | None:
    """The largest size that fit (the most relevant), else the smallest that was measured."""
    if max_fit and trials[max_fit].peak_memory_bytes:
        return trials[max_fit]
    measured = [t for t in trials.values() if t.peak_memory_bytes and not t.peak_is_lower_bound]
    return min(measured, key=lambda t: t.micro_batch_size, default=None)


def _measured_bytes_per_sequence(trials: dict[int, Trial]) -> int | None:
    """Activation memory per sequence: the least-squares slope of peak against size over the sizes that fit
    (two neighbouring sizes alone differ by little more than the measurement's noise)."""
    points = [(t.micro_batch_size, t.peak_memory_bytes) for t in trials.values() if t.fits and t.peak_memory_bytes]
    if len(points) < 2:
        return None
    mean_b = sum(b for b, _ in points) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    return int(sum((b - mean_b) * (p - mean_p) for b, p in points) / spread)


# ------------------------------------------------------------------------------------------------- --write


def write_micro_batch(run_dir: Path, report: dict[str, Any], pick: str) -> dict[str, Any]:
    """Set train.json's micro_batch_size to the best (fastest) or the largest size that fits with an exact
    accumulation; other keys, their order and values are kept. Returns {path, old, new}."""
    new = report["best_micro_batch"] if pick == "best" else report["max_exact_micro_batch"]
    if new is None or (pick == "best" and report["grad_accum_at_best"] is None):
        raise ConfigError(f"--write: no micro-batch that fits divides the global batch of "
                          f"{report['global_batch_tokens']:,} tokens exactly",
                          "change global_batch_tokens to a multiple of micro_batch_size x seq_len x world size, "
                          "see the table")
    path = Path(run_dir) / "train.json"
    raw = read_json(path)
    old = raw.get("micro_batch_size")
    updated = {**raw, "micro_batch_size": new}  # same key order: the key exists (it is required)
    _check_still_valid(path, run_dir, updated, report["world_size"])
    save_json(path, updated)
    return {"path": str(path), "old": old, "new": new}


def _check_still_valid(path: Path, run_dir: Path, raw: dict[str, Any], world: int) -> None:
    from nanopt.config import load_model_config

    model = load_model_config(Path(run_dir) / "model.json")
    train = from_dict(TrainConfig, raw, f"{path} (after --write)")
    train.validate(model, f"{path} (after --write)")
    RunConfig(run_dir=Path(run_dir), model=model, train=train).grad_accum_steps(world)
