"""Running one trial: real training steps at a micro-batch size, in a process of its own or in the ranks' own.

See the package docstring for where a trial runs and why.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import traceback
from typing import Any

from nanopt.config import RunConfig
from nanopt.devices import MemoryProbe, device_name
from nanopt.errors import NanoptError
from nanopt.plan.find_batch.search import FindBatchOptions, agree, judge, memory_limit, trial_run, usable_bytes
from nanopt.train.guard.oom import is_out_of_memory

POLL_S = 0.02  # how often the parent samples a CPU trial's resident memory
PREDICTED_OOM_FACTOR = 1.25  # under torchrun: skip sizes extrapolated to exceed the limit by this factor

# --------------------------------------------------------------------------------------------- one trial


def measure(run: RunConfig, rt: Any, steps: int, probe: MemoryProbe) -> dict[str, Any]:
    """Run `steps` real training steps of `run` in this process and clean up; the measurement as plain data."""
    import torch

    from nanopt.devices import device_peak_flops
    from nanopt.train.health.probe import HealthProbe
    from nanopt.train.parallel.wrap import resolve_compile
    from nanopt.train.session import build_session
    from nanopt.train.step import step

    compiled = resolve_compile(run.train.compile, rt.device)
    peak_flops, peak_source = device_peak_flops(rt.device, rt.precision, rt.tf32)
    probe.reset()
    baseline = probe.current()
    session, status, detail, times = None, "ok", "", []
    try:
        session = build_session(run, rt, writes=False)
        if run.train.health:  # the probe training runs at log steps (a trial's: search.trial_run)
            session.health_probe = HealthProbe(session.prepared.raw, session.optimizer, rt)
        for _ in range(steps):
            started = time.perf_counter()
            step(session)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            times.append(time.perf_counter() - started)
    except RuntimeError as exc:  # torch.OutOfMemoryError, or cuBLAS failing to allocate its workspace
        if not is_out_of_memory(exc):
            raise
        status, detail = "oom", str(exc).strip().splitlines()[0][:300]
    peak = probe.peak()
    del session
    _release(rt.device, compiled)
    return {"status": status, "detail": detail, "peak_memory_bytes": peak, "baseline_bytes": baseline,
            "step_times_s": times, "device": rt.device.type, "device_name": device_name(rt.device),
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


def _trial_process(run: RunConfig, steps: int, gpu_memory: int | None, conn: Any, requester: int) -> None:
    """Entry point of a trial process: measure, send the result to the parent, exit."""
    from nanopt.runtime import init_runtime

    _exit_when_gone(requester)
    try:
        rt = init_runtime(run.train.precision, tf32=run.train.tf32)
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
    return ("oom: " if is_out_of_memory(exc) else "") + last_line[:300]


# ------------------------------------------------------------------------------------------ trial runners


def _report_device(run: RunConfig, conn: Any) -> None:
    """In a throwaway process: whether CUDA is here, and what the memory model needs to know of the device."""
    import torch

    from nanopt.runtime import resolve_precision
    from nanopt.train.parallel.wrap import resolve_compile

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    try:
        facts = {"cuda": cuda, "precision": resolve_precision(run.train.precision, device),
                 "compiled": resolve_compile(run.train.compile, device),
                 "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None}
    except NanoptError as exc:  # an unsupported precision: the first trial reports it
        facts = {"cuda": cuda, "precision": None, "compiled": False, "device_memory_bytes": None,
                 "error": exc.message}
    conn.send(facts)
    conn.close()


class ProcessTrials:
    """One process per trial (see the module docstring); on the CPU the parent also watches its memory."""

    def __init__(self, run: RunConfig, opts: FindBatchOptions) -> None:
        import multiprocessing

        self.run, self.opts = run, opts
        self.ctx = multiprocessing.get_context("forkserver")
        # Imported once in the server, so a trial starts in well under a second (never CUDA: that stays per trial).
        self.ctx.set_forkserver_preload(["__main__", "nanopt.plan.find_batch.trials", "nanopt.train.loop",
                                         "nanopt.model.transformer", "nanopt.data.loaders.loader"])

    def device_facts(self) -> dict[str, Any]:
        """{cuda, precision, compiled, device_memory_bytes}, asked in a process forked from the server, so this one
        never touches CUDA (a trial process would then inherit a CUDA context it cannot use)."""
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=_report_device, args=(self.run, child_conn), name="find-batch-device")
        process.start()
        child_conn.close()
        try:
            return parent_conn.recv()
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
        bound = usable_bytes(self.opts.max_memory, self.opts.margin) if self.opts.max_memory else None
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


class InProcessTrials:
    """Trials in this process: one process on a GPU without compile (an OOM is caught, the trial's memory freed
    and the allocator's cache emptied before the next), or each rank's own under torchrun, where measurements are
    made identical on every rank."""

    def __init__(self, run: RunConfig, opts: FindBatchOptions, rt: Any) -> None:
        self.run, self.opts, self.rt = run, opts, rt
        self.probe = MemoryProbe(rt.device, opts.gpu_memory)
        self.fitted: list[tuple[int, int]] = []  # (micro-batch, peak) of sizes that fit, the same on every rank

    def __call__(self, micro_batch_size: int) -> dict[str, Any]:
        from nanopt.runtime import all_reduce_max

        limit = memory_limit(self.opts, self.probe.device_memory_bytes)
        # Only where an OOM could strand the other ranks in a collective; one process just runs the size.
        predicted = _extrapolate(self.fitted, micro_batch_size) if self.rt.distributed else None
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
        from nanopt.devices import device_peak_flops
        from nanopt.train.parallel.wrap import resolve_compile

        peak_flops, peak_source = device_peak_flops(self.rt.device, self.rt.precision, self.rt.tf32)
        return {"device": self.rt.device.type, "device_name": device_name(self.rt.device),
                "device_memory_bytes": self.probe.device_memory_bytes, "context_bytes": self.probe.context_bytes,
                "precision": self.rt.precision, "compiled": resolve_compile(self.run.train.compile, self.rt.device),
                "peak_flops": peak_flops, "peak_source": peak_source, "baseline_bytes": None}


def _extrapolate(fitted: list[tuple[int, int]], size: int) -> float | None:
    """Peak at `size` on the line through the two largest sizes that fit; None with fewer than two."""
    if len(fitted) < 2:
        return None
    (b1, p1), (b2, p2) = sorted(fitted)[-2:]
    return p2 + (p2 - p1) / (b2 - b1) * (size - b2)


