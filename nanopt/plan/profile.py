"""`nanopt profile`: where the time of the real training step goes, as a trace and a summary a person can act on.

The run's own step (`nanopt.train.session.build_session` + `nanopt.train.step.step`: same model, dtype, compile,
accumulation and parallelism) runs under torch.profiler with the schedule wait / warmup / active. The active steps
are exported as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing), copied into a directory
named as torch's `tensorboard_trace_handler` names its files (for TensorBoard's PyTorch profiler plugin); and they
are summarized:

- step time split into busy and idle: on a GPU, busy = the union of the intervals in which a kernel or memcpy ran
  (`record_function` ranges mirrored on the GPU timeline are no work, and left out); on the CPU, busy = the self
  time of every profiled operator (Python glue between operators, the dispatcher outside operators and the
  profiler itself are the idle rest);
- the operators (CPU) or kernels (GPU) with the most self time, and their shares grouped into categories; what
  runs inside an optimizer step, a collective, an attention call or a loader wait counts for that category. On a
  GPU each kernel is counted once, at its time on the device timeline (nanopt.plan.profile_events.timeline_kernels),
  each top kernel names the operator that launched it (`launched_by`), and `kernel_overlap` is the kernels' summed
  time over the busy time: above 1, kernels ran on several streams at once, and the shares are of that sum, not of
  the step (`notes` says so, and when the profiler listed kernels under more than one operator);
- host overhead: on the CPU the idle time above; on a GPU the host's own time inside operators and kernel
  launches, without the time it spent waiting for the GPU (CUDA synchronize calls and copies, counted apart as
  `cpu_wait_s`); the step is host-bound when that overhead is larger than the GPU's busy time;
- the share of the step spent waiting for the data loader (`loader.next_batch`, labelled `nanopt.data_wait` in
  the trace), peak memory, tokens/s and MFU under the profiler (profiling slows a step down, so these are lower
  bounds), and with torch.compile the number of graphs and the reasons for graph breaks.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.config import RunConfig
from nanopt.config.seq_stages import longest
from nanopt.errors import ConfigError
from nanopt.files import check_run_dir, copy_file, make_dir, replacing
from nanopt.model.flops import mfu, mfu_note
from nanopt.parsing import check_option, save_json
from nanopt.plan.profile_events import (
    CATEGORIES,
    DATA_WAIT_LABEL,
    aggregate,
    collect,
    launchers,
    timeline_kernels,
    union_us,
)
from nanopt.rundir import RunDir

TRACE_FILE = "trace.json"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
US = 1e-6  # the profiler counts microseconds
MAX_PROFILE_STEPS = 10_000


@dataclass(frozen=True)
class ProfileOptions:
    wait: int = 1  # steps run before the profiler starts (the first step allocates state and compiles)
    warmup: int = 2  # steps profiled but discarded (the profiler's own start-up)
    active: int = 3  # steps recorded and summarized
    record_shapes: bool = False
    profile_memory: bool = False  # allocations in the trace: a larger trace, and a slower one to write and read
    tensorboard: bool = True
    top: int = 15
    out_dir: Path | None = None  # default: runs/NAME/profile

    def validate(self) -> None:
        # At most MAX_PROFILE_STEPS steps in each phase: a profile of more is a typo (and a trace of 2**63 steps
        # would never finish).
        hint = f"need --wait >= 0, --warmup >= 0, --steps >= 1, --top >= 1, each at most {MAX_PROFILE_STEPS:,}"
        check_option("--wait", self.wait, 0, MAX_PROFILE_STEPS, hint)
        check_option("--warmup", self.warmup, 0, MAX_PROFILE_STEPS, hint)
        check_option("--steps", self.active, 1, MAX_PROFILE_STEPS, hint)
        check_option("--top", self.top, 1, MAX_PROFILE_STEPS, hint)
        if self.out_dir is not None and Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError(f"--out {self.out_dir}: is a file, not a directory",
                              "give a directory for the traces (made if missing), or leave --out out")


# -------------------------------------------------------------------------------------------- data waits


class TimedLoader:
    """The session's loader, with every next_batch labelled in the trace and its wall time counted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.waited_s = 0.0

    def next_batch(self) -> Any:
        from torch.profiler import record_function

        started = time.perf_counter()
        with record_function(DATA_WAIT_LABEL):
            batch = self.inner.next_batch()
        self.waited_s += time.perf_counter() - started
        return batch

    def take(self) -> float:
        """Seconds waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def __getattr__(self, name: str) -> Any:  # state_dict() and the rest, unchanged
        return getattr(self.inner, name)


# ---------------------------------------------------------------------------------------------- profiling


def profile_run(run: RunConfig, opts: ProfileOptions,
                on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Profile `wait + warmup + active` real training steps; write the traces and summary.json (rank 0 writes
    trace.json and the summary; other ranks trace-rankN.json) and return the summary (every rank)."""
    from nanopt.runtime import init_runtime, shutdown

    opts.validate()
    check_run_dir(run.run_dir)  # profile/ (and every path nanopt writes there) is no link, before any step
    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    try:
        return _profile(run, rt, opts, on_step)
    finally:
        shutdown(rt)


def _profile(run: RunConfig, rt: Any, opts: ProfileOptions, on_step: Callable[[int, int], None] | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from nanopt.train.parallel.wrap import resolve_compile
    from nanopt.train.session import build_session
    from nanopt.train.shape_schedule import skip_the_ramp, skip_to_the_longest_stage
    from nanopt.train.step import step

    compiled = resolve_compile(run.train.compile, rt.device)
    if compiled:
        torch._dynamo.utils.counters.clear()  # count this run's graphs and breaks only
    session = build_session(run, rt, writes=False)
    skip_the_ramp(session)  # batch warmup: profile the full-size steps that take most of the run
    skip_to_the_longest_stage(session)  # seq_len stages: the longest's step, the slowest
    loader = TimedLoader(session.loader)
    session.loader = loader
    out_dir = Path(opts.out_dir or RunDir(run.run_dir).profile_dir)
    make_dir(out_dir, parents=True)
    trace_path = out_dir / (TRACE_FILE if rt.is_main else f"trace-rank{rt.rank}.json")
    collected: dict[str, Any] = {}

    def on_trace_ready(prof: Any) -> None:
        collected.update(collect(prof, rt.device.type == "cuda"))
        _export(prof, trace_path, out_dir / TENSORBOARD_DIR if opts.tensorboard else None, rt.rank)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    first_active, total = opts.wait + opts.warmup, opts.wait + opts.warmup + opts.active
    step_times, waits = [], []
    with profile(activities=activities, record_shapes=opts.record_shapes, profile_memory=opts.profile_memory,
                 schedule=schedule(wait=opts.wait, warmup=opts.warmup, active=opts.active, repeat=1),
                 on_trace_ready=on_trace_ready) as prof:
        for index in range(total):
            loader.take()
            started = time.perf_counter()
            step(session)
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)
            if index >= first_active:
                step_times.append(time.perf_counter() - started)
                waits.append(loader.take())
            prof.step()
            if on_step:
                on_step(index + 1, total)
    summary = summarize(session, opts, collected, step_times, waits, compiled)
    summary["trace"] = str(trace_path)
    summary["tensorboard_dir"] = str(out_dir / TENSORBOARD_DIR) if opts.tensorboard else None
    if rt.is_main:
        summary["summary_path"] = str(out_dir / SUMMARY_FILE)
        save_json(out_dir / SUMMARY_FILE, summary)
    return summary


def _export(prof: Any, trace_path: Path, tensorboard_dir: Path | None, rank: int) -> None:
    """The Chrome trace, written whole or not at all; and a copy named as TensorBoard's profiler plugin expects
    (`WORKER.SPAN.pt.trace.json`, what torch's tensorboard_trace_handler writes; a trace can be exported once).
    torch's exporter opens the path it is given, so it writes into a new private directory (which no link can be
    planted in) and the trace is copied from there, never through a link (nanopt.files)."""
    with tempfile.TemporaryDirectory(dir=trace_path.parent, prefix=".trace-") as private:
        exported = Path(private, trace_path.name)
        prof.export_chrome_trace(str(exported))
        with open(exported, "rb") as source, replacing(trace_path) as target:
            shutil.copyfileobj(source, target, 1 << 22)
    if tensorboard_dir is not None:
        make_dir(tensorboard_dir)
        for old in tensorboard_dir.glob(f"rank{rank}.*.pt.trace.json"):
            old.unlink()  # one trace per rank: the plugin would show stale ones as extra runs
        copy_file(trace_path, tensorboard_dir / f"rank{rank}.{time.time_ns()}.pt.trace.json")


# --------------------------------------------------------------------------------------------- summarize


def summarize(session: Any, opts: ProfileOptions, collected: dict[str, Any], step_times: list[float],
              waits: list[float], compiled: bool) -> dict[str, Any]:
    """The JSON summary of the active steps (see the module docstring for what each number means)."""
    run, rt = session.run, session.rt
    steps = len(step_times)
    step_time = sum(step_times) / steps
    on_cuda = rt.device.type == "cuda"
    host_ops = aggregate(collected.get("host", []))
    host_time = sum(row[2] for row in host_ops) * US / steps
    listed_twice = 0
    if on_cuda:
        ops, listed_twice = timeline_kernels(collected.get("kernels", []), collected.get("timeline", []))
        busy = union_us(collected.get("intervals", [])) * US / steps
        overhead, measure = host_time, "GPU kernels and copies (union of their intervals)"
        waited: float | None = sum(collected.get("waits", [])) * US / steps
    else:
        ops = host_ops
        busy = host_time
        overhead, measure = max(0.0, step_time - busy), "CPU operator self time"
        waited = None  # no device to wait for
    busy = min(busy, step_time)
    overlap = _kernel_overlap(ops, busy, steps) if on_cuda else None
    tokens_per_s = run.train.global_batch_tokens / step_time
    # session.flops_per_token is the profiled stage's (skip_to_the_longest_stage)
    utilization = mfu(tokens_per_s, session.flops_per_token, rt.world_size, session.peak_flops)
    data_wait = sum(waits) / steps
    seq_len, micro_batch_size = _profiled_shape(run)
    return {
        "run": str(run.run_dir), "device": rt.device.type, "precision": rt.precision, "tf32": rt.tf32,
        "compiled": compiled,
        "world_size": rt.world_size, "parallelism": run.train.parallelism,
        "activation_checkpointing": run.train.activation_checkpointing,
        "micro_batch_size": micro_batch_size, "grad_accum": session.accum, "seq_len": seq_len,
        "tokens_per_step": run.train.global_batch_tokens,
        "schedule": {"wait": opts.wait, "warmup": opts.warmup, "active": opts.active},
        "step_time_s": step_time, "busy_s": busy, "idle_s": step_time - busy, "busy_share": busy / step_time,
        "idle_share": 1 - busy / step_time, "busy_measure": measure,
        "cpu_overhead_s": overhead, "cpu_overhead_share": min(1.0, overhead / step_time),
        "cpu_wait_s": waited, "host_bound": bool(on_cuda and overhead > busy),
        "data_wait_s": data_wait, "data_wait_share": min(1.0, data_wait / step_time),
        "categories": _categories(ops, steps),
        "kernel_overlap": overlap, "streams": collected.get("streams") if on_cuda else None,
        "kernels_listed_twice_per_step": listed_twice / steps if on_cuda else None,
        "notes": _kernel_notes(overlap, collected.get("streams") or [], listed_twice / steps),
        "top_ops": _top(ops, steps, opts.top, launchers(collected.get("kernels", [])) if on_cuda else None),
        "peak_memory_bytes": session.memory.peak(),
        "peak_memory_measure": "peak reserved GPU memory plus the CUDA context" if on_cuda else "peak resident "
                               "memory of the process (Python, torch and the profiler incl.)",
        "tokens_per_s": tokens_per_s, "mfu": utilization, "mfu_note": mfu_note(utilization, session.peak_flops),
        "peak_flops": session.peak_flops,
        "peak_source": session.peak_source,
        "compile": compile_report(compiled),
    }


def _categories(ops: list[tuple[str, str, float, int]], steps: int) -> list[dict[str, Any]]:
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for _, category, micros, _ in ops:
        totals[category] += micros
    whole = sum(totals.values()) or 1.0
    return [{"category": c, "seconds_per_step": t * US / steps, "share": t / whole}
            for c, t in sorted(totals.items(), key=lambda item: -item[1])]


def _top(ops: list[tuple[str, str, float, int]], steps: int, count: int,
         launched_by: dict[str, str] | None) -> list[dict[str, Any]]:
    whole = sum(row[2] for row in ops) or 1.0
    top = [{"name": short_kernel_name(name)[:160], "category": category, "seconds_per_step": micros * US / steps,
            "share": micros / whole, "calls_per_step": calls / steps} for name, category, micros, calls in ops[:count]]
    if launched_by is not None:
        for op, (name, *_) in zip(top, ops, strict=False):
            op["launched_by"] = launched_by.get(name)
    return top


def short_kernel_name(name: str) -> str:
    """A C++ kernel's name without the namespaces that make up most of it, so the part that tells kernels apart (the
    functor of a `multi_tensor_apply_kernel`: LpNorm, a binary op) survives the cut to 160 characters."""
    for noise in ("at::native::(anonymous namespace)::", "at::native::", "void "):
        name = name.replace(noise, "")
    return name


# Kernels on one stream cannot overlap: their sum above the busy union by more than this is worth a word.
OVERLAP_TOLERANCE = 1.05


def _kernel_overlap(ops: list[tuple[str, str, float, int]], busy_s: float, steps: int) -> float | None:
    """The kernels' summed time over the GPU's busy time (1.0: every kernel ran alone)."""
    summed = sum(row[2] for row in ops) * US / steps
    return summed / busy_s if busy_s > 0 else None


def _kernel_notes(overlap: float | None, streams: list, listed_twice: float) -> list[str]:
    """What to know before reading the category table of a GPU profile (nothing, usually)."""
    notes = []
    if overlap is not None and overlap > OVERLAP_TOLERANCE:
        notes.append(f"kernels ran on {len(streams)} streams at once: their times add up to {overlap:.0%} of the "
                     "GPU's busy time, and the category shares are of that sum, not of the step")
    if listed_twice >= 1:
        notes.append(f"the profiler listed {listed_twice:,.0f} kernel launches per step under more than one "
                     "operator (colliding correlation ids); each kernel is counted once, at its time on the GPU, "
                     "and `launched_by` may name the wrong operator for those")
    return notes


def compile_report(compiled: bool) -> dict[str, Any]:
    """Graphs dynamo produced and why it broke graphs, from its counters; or that compile is off.

    A frame Dynamo gave up on (a graph break inside a loop, an untraceable call) runs eagerly, whole, and is not
    in `counters["graph_break"]`: it is counted here as a graph break of its own, with the reasons Dynamo gave."""
    if not compiled:
        return {"enabled": False, "graphs": None, "graph_breaks": None, "skipped_frames": None, "break_reasons": [],
                "note": "compile off"}
    from torch._dynamo.utils import counters

    reasons = sorted(counters["graph_break"].items(), key=lambda item: -item[1])
    skipped = max(0, int(counters["frames"]["total"]) - int(counters["frames"]["ok"]))
    if skipped:
        why = "; ".join(str(reason).splitlines()[0] for reason in counters["unimplemented"]) or "no reason recorded"
        reasons.insert(0, (f"frames skipped by dynamo, run eagerly ({why})", skipped))  # first: a whole frame
    return {"enabled": True, "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(count for _, count in reasons)), "skipped_frames": skipped,
            "break_reasons": [{"reason": str(reason)[:300], "count": int(count)} for reason, count in reasons],
            "note": "counted by torch._dynamo during the profiled run"}


def _profiled_shape(run: RunConfig) -> tuple[int, int]:
    """(seq_len, micro_batch_size) of the profiled steps: under seq_len stages the longest stage's."""
    if run.train.seq_len_stages is None:
        return run.seq_len, run.train.micro_batch_size
    stage = longest(run.seq_stages)
    return stage.seq_len, stage.micro_batch_size
