"""`nanopt profile`: where the time of the real training step goes, as a trace and a summary a person can act on.

The run's own step (`nanopt.train.session.build_session` + `nanopt.train.step.step`: same model, dtype, compile,
accumulation and parallelism) runs under torch.profiler with the schedule wait / warmup / active. The active steps
are exported as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing), copied into a directory
named as torch's `tensorboard_trace_handler` names its files (for TensorBoard's PyTorch profiler plugin); and they
are summarized:

- step time split into busy and idle: on a GPU, busy = the union of the intervals in which a kernel or memcpy ran;
  on the CPU, busy = the self time of every profiled operator (Python glue between operators, the dispatcher
  outside operators and the profiler itself are the idle rest);
- the operators (CPU) or kernels (GPU) with the most self time, and their shares grouped into categories; what
  runs inside an optimizer step, a collective, an attention call or a loader wait counts for that category;
- host overhead: on the CPU the idle time above; on a GPU the host's own time inside operators and kernel
  launches, which bounds the step when it is larger than the device's busy time;
- the share of the step spent waiting for the data loader (`loader.next_batch`, labelled `nanopt.data_wait` in
  the trace), peak memory, tokens/s and MFU under the profiler (profiling slows a step down, so these are lower
  bounds), and with torch.compile the number of graphs and the reasons for graph breaks.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.files import check_run_dir, copy_file, make_dir, replacing
from nanopt.model.flops import mfu, mfu_note
from nanopt.parsing import check_option, save_json
from nanopt.rundir import RunDir

DATA_WAIT_LABEL = "nanopt.data_wait"
TRACE_FILE = "trace.json"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
US = 1e-6  # the profiler counts microseconds
MAX_PROFILE_STEPS = 10_000

CATEGORIES = ("matmul", "attention", "optimizer", "elementwise/norm/activation", "communication",
              "data loading/copies", "other")


@dataclass(frozen=True)
class ProfileOptions:
    wait: int = 1  # steps run before the profiler starts (the first step allocates state and compiles)
    warmup: int = 2  # steps profiled but discarded (the profiler's own start-up)
    active: int = 3  # steps recorded and summarized
    record_shapes: bool = False
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


# --------------------------------------------------------------------------------------------- categories

_MATMUL_OPS = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "addbmm", "_addmm_activation", "mv", "addmv",
               "dot", "einsum", "_scaled_mm", "_int_mm"}
_COPY_OPS = {"copy_", "_to_copy", "to", "_copy_from", "_copy_from_and_resize", "pin_memory", "_pin_memory",
             "lift_fresh", "lift_fresh_copy", "clone"}
# Operators that only make views or allocate: no arithmetic, counted as "other" rather than elementwise.
_NO_COMPUTE_OPS = {"view", "reshape", "_reshape_alias", "t", "transpose", "as_strided", "expand", "permute", "slice",
                   "select", "unsqueeze", "squeeze", "contiguous", "detach", "_unsafe_view", "empty", "empty_like",
                   "empty_strided", "resize_", "alias", "split", "split_with_sizes", "chunk", "unbind", "narrow",
                   "flatten", "unflatten", "set_", "result_type", "item", "_local_scalar_dense", "is_nonzero",
                   "zeros", "zeros_like", "ones", "ones_like", "embedding", "embedding_backward",
                   "embedding_dense_backward", "index_select", "index", "index_put_", "gather", "scatter",
                   "scatter_add_", "arange", "full", "scalar_tensor", "new_empty", "new_empty_strided",
                   "new_zeros", "record_stream"}
_COMMUNICATION = ("nccl", "gloo", "c10d", "record_param_comms", "all_reduce", "allreduce", "all_gather",
                  "allgather", "reduce_scatter", "broadcast", "all_to_all")
_OPTIMIZER = ("optimizer.", "_foreach_", "adam", "clip_grad", "multi_tensor_apply", "_fused_sgd")
_ATTENTION = ("attention", "flash", "fmha", "sdpa", "attn")
_MATMUL_KERNELS = ("gemm", "gemv", "cutlass", "xmma", "cublas", "triton_tem_fused", "matmul", "_mm_", "wgmma")
_COPY_KERNELS = ("memcpy", "memset")
_ELEMENTWISE_KERNELS = ("elementwise", "vectorized", "reduce", "norm", "softmax", "triton_", "silu", "gelu",
                        "unrolled", "cross_entropy", "nll_loss", "cat_", "fill", "pointwise", "activation")


def categorize(name: str) -> str:
    """The category of an operator (`aten::mm`) or a GPU kernel name (`sm90_xmma_gemm_...`)."""
    low = name.lower()
    if any(word in low for word in _COMMUNICATION):
        return "communication"
    if low.startswith(DATA_WAIT_LABEL) or any(word in low for word in _COPY_KERNELS):
        return "data loading/copies"
    if any(word in low for word in _OPTIMIZER):
        return "optimizer"
    if any(word in low for word in _ATTENTION):
        return "attention"
    if low.startswith("aten::"):
        return _aten_category(low.removeprefix("aten::"))
    if "compiledfxgraph" in low:
        # On the CPU, inductor's generated C++ runs inside this frame: fused pointwise and reduction kernels
        # (the matmuls and attention it calls are operators of their own).
        return "elementwise/norm/activation"
    if low.startswith(("autograd::", "torch::autograd::")) or low.endswith(("backward0", "backward1")):
        return "other"  # autograd engine bookkeeping; the arithmetic is in the operators it calls
    if any(word in low for word in _MATMUL_KERNELS):
        return "matmul"
    if any(word in low for word in _ELEMENTWISE_KERNELS):
        return "elementwise/norm/activation"
    return "other"


def _aten_category(op: str) -> str:
    if op in _MATMUL_OPS:
        return "matmul"
    if op in _COPY_OPS:
        return "data loading/copies"
    if op in _NO_COMPUTE_OPS:
        return "other"
    return "elementwise/norm/activation"  # the rest of aten: arithmetic, norms, activations, softmax / loss


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
    rt = init_runtime(run.train.precision)
    try:
        return _profile(run, rt, opts, on_step)
    finally:
        shutdown(rt)


def _profile(run: RunConfig, rt: Any, opts: ProfileOptions, on_step: Callable[[int, int], None] | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from nanopt.train.parallel import resolve_compile
    from nanopt.train.session import build_session
    from nanopt.train.step import step

    compiled = resolve_compile(run.train.compile, rt.device)
    if compiled:
        torch._dynamo.utils.counters.clear()  # count this run's graphs and breaks only
    session = build_session(run, rt, writes=False)
    loader = TimedLoader(session.loader)
    session.loader = loader
    out_dir = Path(opts.out_dir or RunDir(run.run_dir).profile_dir)
    make_dir(out_dir, parents=True)
    trace_path = out_dir / (TRACE_FILE if rt.is_main else f"trace-rank{rt.rank}.json")
    collected: dict[str, Any] = {}

    def on_trace_ready(prof: Any) -> None:
        collected.update(_collect(prof, rt.device.type == "cuda"))
        _export(prof, trace_path, out_dir / TENSORBOARD_DIR if opts.tensorboard else None, rt.rank)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    first_active, total = opts.wait + opts.warmup, opts.wait + opts.warmup + opts.active
    step_times, waits = [], []
    with profile(activities=activities, record_shapes=opts.record_shapes, profile_memory=True,
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


def _collect(prof: Any, on_cuda: bool) -> dict[str, Any]:
    """What the summary needs, as plain data, while the recorded events are still there.

    host: (name, category, self microseconds) of every CPU event but the per-step frame.
    kernels: (name, category, microseconds) of every GPU kernel / copy, attributed through the CPU event that
    launched it. intervals: (start, end) of every device event, for the busy time.
    """
    from torch.autograd import DeviceType

    owners: dict[int, str | None] = {}
    host, kernels, intervals = [], [], []
    for event in prof.events():
        if event.device_type != DeviceType.CPU:
            if not event.is_async:
                intervals.append((event.time_range.start, event.time_range.end))
            continue
        if event.is_async:
            continue
        owner = _owner(event, owners)
        if not event.name.startswith("ProfilerStep"):  # its self time is the glue between operators: idle
            host.append((event.name, owner or categorize(event.name), event.self_cpu_time_total))
        for kernel in event.kernels if on_cuda else ():
            kernels.append((kernel.name, owner or _kernel_category(kernel.name, event), kernel.duration))
    return {"host": host, "kernels": kernels, "intervals": intervals}


_OWNING = {"optimizer", "communication", "attention"}


def _owner(event: Any, owners: dict[int, str | None]) -> str | None:
    """The category of the nearest enclosing optimizer step, collective, attention call or loader wait.

    The arithmetic inside them (AdamW's per-tensor lerp_ and addcdiv_ on the CPU, the matmuls of an attention
    fallback) belongs to them: that is the decision a person makes (a fused optimizer, a flash kernel).
    """
    chain = []
    node = event
    while node is not None and id(node) not in owners:
        chain.append(node)
        node = node.cpu_parent
    found = owners.get(id(node)) if node is not None else None
    for item in reversed(chain):  # outermost first: an owner found higher up covers everything below it
        if found is None:
            own = categorize(item.name)
            if own in _OWNING or item.name.startswith(DATA_WAIT_LABEL):
                found = own
        owners[id(item)] = found
    return owners[id(event)]


def _kernel_category(kernel_name: str, launcher: Any) -> str:
    """A kernel by its own name, else by the operator that launched it (e.g. a generic elementwise template)."""
    category = categorize(kernel_name)
    node = launcher
    while category == "other" and node is not None:
        if node.name.startswith("aten::"):
            category = categorize(node.name)
        node = node.cpu_parent
    return category


# --------------------------------------------------------------------------------------------- summarize


def summarize(session: Any, opts: ProfileOptions, collected: dict[str, Any], step_times: list[float],
              waits: list[float], compiled: bool) -> dict[str, Any]:
    """The JSON summary of the active steps (see the module docstring for what each number means)."""
    run, rt = session.run, session.rt
    steps = len(step_times)
    step_time = sum(step_times) / steps
    on_cuda = rt.device.type == "cuda"
    host_ops = _aggregate(collected.get("host", []))
    host_time = sum(row[2] for row in host_ops) * US / steps
    if on_cuda:
        ops = _aggregate(collected.get("kernels", []))
        busy = _union_us(collected.get("intervals", [])) * US / steps
        overhead, measure = host_time, "GPU kernels and copies (union of their intervals)"
    else:
        ops = host_ops
        busy = host_time
        overhead, measure = max(0.0, step_time - busy), "CPU operator self time"
    busy = min(busy, step_time)
    tokens_per_s = run.train.global_batch_tokens / step_time
    utilization = mfu(tokens_per_s, session.flops_per_token, rt.world_size, session.peak_flops)
    data_wait = sum(waits) / steps
    return {
        "run": str(run.run_dir), "device": rt.device.type, "precision": rt.precision, "compiled": compiled,
        "world_size": rt.world_size, "parallelism": run.train.parallelism,
        "activation_checkpointing": run.train.activation_checkpointing,
        "micro_batch_size": run.train.micro_batch_size, "grad_accum": session.accum, "seq_len": run.seq_len,
        "tokens_per_step": run.train.global_batch_tokens,
        "schedule": {"wait": opts.wait, "warmup": opts.warmup, "active": opts.active},
        "step_time_s": step_time, "busy_s": busy, "idle_s": step_time - busy, "busy_share": busy / step_time,
        "idle_share": 1 - busy / step_time, "busy_measure": measure,
        "cpu_overhead_s": overhead, "cpu_overhead_share": min(1.0, overhead / step_time),
        "host_bound": bool(on_cuda and overhead > busy),
        "data_wait_s": data_wait, "data_wait_share": min(1.0, data_wait / step_time),
        "categories": _categories(ops, steps),
        "top_ops": _top(ops, steps, opts.top),
        "peak_memory_bytes": session.memory.peak(),
        "peak_memory_measure": "peak reserved GPU memory plus the CUDA context" if on_cuda else "peak resident "
                               "memory of the process (Python, torch and the profiler incl.)",
        "tokens_per_s": tokens_per_s, "mfu": utilization, "mfu_note": mfu_note(utilization, session.peak_flops),
        "peak_flops": session.peak_flops,
        "peak_source": session.peak_source,
        "compile": compile_report(compiled),
    }


def _aggregate(rows: list[tuple[str, str, float]]) -> list[tuple[str, str, float, int]]:
    """(name, category, microseconds, calls) summed by name and category, largest first."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for name, category, micros in rows:
        totals[(name, category)][0] += micros
        totals[(name, category)][1] += 1
    return sorted(((n, c, t, int(k)) for (n, c), (t, k) in totals.items()), key=lambda row: -row[2])


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds in which at least one kernel ran (overlapping streams counted once)."""
    busy, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy


def _categories(ops: list[tuple[str, str, float, int]], steps: int) -> list[dict[str, Any]]:
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for _, category, micros, _ in ops:
        totals[category] += micros
    whole = sum(totals.values()) or 1.0
    return [{"category": c, "seconds_per_step": t * US / steps, "share": t / whole}
            for c, t in sorted(totals.items(), key=lambda item: -item[1])]


def _top(ops: list[tuple[str, str, float, int]], steps: int, count: int) -> list[dict[str, Any]]:
    whole = sum(row[2] for row in ops) or 1.0
    return [{"name": name[:160], "category": category, "seconds_per_step": micros * US / steps,
             "share": micros / whole, "calls_per_step": calls / steps} for name, category, micros, calls in ops[:count]]


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
