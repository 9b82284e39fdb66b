"""The profiler's events as the numbers `nanopt profile` summarizes: categories of operators and kernels, what the
device was busy with, and where the host spent its time.

On a GPU the profiler reports more than kernels and copies on the device timeline: `record_function` ranges (the
step's `ProfilerStep#N`, the optimizer's `Optimizer.step#...`, nanopt's data-wait label) are mirrored there as user
annotations spanning everything launched inside them, and appear among the kernels a CPU event launched. Counting
them would make a step's first-to-last-kernel span busy time, gaps and all; they are left out. On the host, the
CUDA runtime calls that wait for the device (synchronize calls and memory copies, e.g. the `.tolist()` of each
step's losses and the synchronize after each profiled step) are the host waiting, not host overhead: they are
counted apart (`waits`), so a GPU-bound step does not read as host-bound.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

DATA_WAIT_LABEL = "nanopt.data_wait"

CATEGORIES = ("matmul", "attention", "optimizer", "elementwise/norm/activation", "communication",
              "data loading/copies", "other")

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


# ---------------------------------------------------------------------------------------------- events


def collect(prof: Any, on_cuda: bool) -> dict[str, Any]:
    """What the summary needs, as plain data, while the recorded events are still there.

    host: (name, category, self microseconds) of every CPU event but the per-step frame and the waits.
    waits: self microseconds of every CUDA runtime call that waits for the device (device_wait).
    kernels: (name, category, the CPU event's name) of every GPU kernel / copy as the CPU events that launched it
    list it (see timeline_kernels): where a surprising kernel comes from. timeline: (name, microseconds) of every
    kernel / copy as it ran on the device, once. intervals: (start, end) of every device event, for the busy time.
    streams: the device streams that ran kernels (whether they could overlap). User annotations are in none.
    """
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [e for e in events if e.device_type != DeviceType.CPU]
    annotations = {e.name for e in device if _is_annotation(e)}
    work = [e for e in device if not e.is_async and e.name not in annotations]
    intervals = [(e.time_range.start, e.time_range.end) for e in work]
    streams = sorted({getattr(e, "device_resource_id", 0) for e in work})
    owners: dict[int, str | None] = {}
    host, kernels, waits = [], [], []
    for event in events:
        if event.device_type != DeviceType.CPU or event.is_async:
            continue
        owner = _owner(event, owners)
        if device_wait(event.name):
            waits.append(event.self_cpu_time_total)
        elif not event.name.startswith("ProfilerStep"):  # its self time is the glue between operators: idle
            host.append((event.name, owner or categorize(event.name), event.self_cpu_time_total))
        for kernel in event.kernels if on_cuda else ():
            if kernel.name not in annotations:
                kernels.append((kernel.name, owner or _kernel_category(kernel.name, event), event.name))
    return {"host": host, "kernels": kernels, "intervals": intervals, "waits": waits, "streams": streams,
            "timeline": [(e.name, e.time_range.end - e.time_range.start) for e in work]}


def _is_annotation(event: Any) -> bool:
    """A `record_function` range mirrored on the device timeline (`gpu_user_annotation`), not work done there. A
    torch without the flag still names the step's span ProfilerStep#N."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("ProfilerStep#")


# CUDA (and ROCm) runtime and driver calls in which the host waits for the device: synchronizations, and memory
# copies (a copy to pageable host memory, like `.tolist()`'s, returns when the device has got that far; an
# asynchronous copy from pinned memory returns at once, so leaving it out costs microseconds).
_WAIT_PREFIXES = ("cuda", "cu", "hip")
_WAIT_WORDS = ("synchronize", "memcpy")


def device_wait(name: str) -> bool:
    """Whether a CPU event is a runtime call that waits for the device (cudaDeviceSynchronize,
    cudaStreamSynchronize, cudaEventSynchronize, cudaMemcpy, cudaMemcpyAsync, their driver and HIP twins)."""
    low = name.lower()
    return name.startswith(_WAIT_PREFIXES) and any(word in low for word in _WAIT_WORDS)


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


# ------------------------------------------------------------------------------------------------- sums


def aggregate(rows: list[tuple[str, str, float]]) -> list[tuple[str, str, float, int]]:
    """(name, category, microseconds, calls) summed by name and category, largest first."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for name, category, micros in rows:
        totals[(name, category)][0] += micros
        totals[(name, category)][1] += 1
    return sorted(((n, c, t, int(k)) for (n, c), (t, k) in totals.items()), key=lambda row: -row[2])


def timeline_kernels(listed: list[tuple[str, str, str]],
                     timeline: list[tuple[str, float]]) -> tuple[list[tuple[str, str, float, float]], int]:
    """The kernels as the device ran them, each once, split between categories as the CPU events that launched them
    say: (name, category, microseconds, calls) rows like aggregate's, largest first, and how many listings there were
    beyond the kernels that ran.

    The profiler links a kernel to every CPU event that carries its correlation id, and those ids can collide
    (pytorch/pytorch#124388): one kernel is then listed under several events, and summing the listings counts it
    several times over (the first 1B Llama profile on an H100 summed its kernels to 176% of the GPU's busy time).
    So time and calls come from the device timeline; the listings only give each kernel name's categories, in
    proportion to how often each was claimed (a kernel inside the optimizer step and the same kernel outside it)."""
    ran: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, micros in timeline:
        ran[name][0] += micros
        ran[name][1] += 1
    claims: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, category, _ in listed:
        claims[name][category] += 1
    rows, extra = [], 0
    for name, (micros, calls) in ran.items():
        by = claims.get(name) or {_kernel_category(name, None): 1}
        whole = sum(by.values())
        extra += max(0, whole - int(calls))
        rows += [(name, category, micros * count / whole, calls * count / whole) for category, count in by.items()]
    return sorted(rows, key=lambda row: -row[2]), extra


def launchers(listed: list[tuple[str, str, str]]) -> dict[str, str]:
    """Each listed kernel name's most frequent launching CPU event."""
    by: dict[str, Counter[str]] = defaultdict(Counter)
    for name, _, launcher in listed:
        by[name][launcher] += 1
    return {name: counts.most_common(1)[0][0] for name, counts in by.items()}


def union_us(intervals: list[tuple[float, float]]) -> float:
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
