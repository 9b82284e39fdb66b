"""What the device a run is on can do and costs (peak FLOP/s, price per hour, name, memory), and how much memory a
run uses on it (MemoryProbe): one rule for estimate, find-batch, profile, preflight and train. Torch is imported
inside the functions, as in nanopt.runtime, so the CLI's fast paths stay fast."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from nanopt.errors import NanoptError
from nanopt.hardware import detect_gpu, machine_memory_bytes

if TYPE_CHECKING:
    import torch


def device_peak_flops(device: torch.device, precision: str, tf32: bool = True) -> tuple[float | None, str]:
    """The dense peak FLOP/s of one rank's device that MFU is measured against, and where it came from: the GPU
    table's (none for fp32 without TF32); on a CPU the peak `nanopt estimate --gpu cpu` works out for this machine
    (nanopt.hardware.cpu_peak), split among the ranks on it, which share its cores. One rule for estimate,
    preflight, find-batch, profile and train."""
    if device.type != "cuda":
        return _cpu_share_of_peak()
    if precision == "fp32" and not tf32:
        return None, "no peak for fp32 without TF32 (train.json \"tf32\": false)"
    import torch

    gpu = detect_gpu(torch.cuda.get_device_name(device))
    if gpu is None:
        return None, f"unknown GPU {torch.cuda.get_device_name(device)!r}"
    return gpu.peak_flops(precision), f"{gpu.name} dense {'TF32' if precision == 'fp32' else 'BF16'} peak"


def _cpu_share_of_peak() -> tuple[float | None, str]:
    from nanopt.hardware import cpu_peak

    found = cpu_peak()
    if found is None:
        return None, "no peak known for this CPU (no /proc/cpuinfo, or vector units nanopt does not know)"
    sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun's ranks on this machine
    return found.flops / sharing, found.describe() + (f", shared by {sharing} ranks" if sharing > 1 else "")


def device_price(device: torch.device, price_per_hour: float | None = None) -> tuple[float | None, str]:
    """USD per device-hour for live cost and projections, and where it came from: the run's own price when given,
    else the GPU table's typical on-demand price for a known GPU, else none (a CPU, an unknown card)."""
    if price_per_hour is not None:
        return price_per_hour, "price_per_hour"
    if device.type != "cuda":
        return None, "no price for CPUs: set price_per_hour (or --price-per-hour)"
    import torch

    gpu = detect_gpu(torch.cuda.get_device_name(device))
    if gpu is None:
        return None, f"unknown GPU {torch.cuda.get_device_name(device)!r}: set price_per_hour"
    return gpu.usd_per_hour, f"typical on-demand price of the {gpu.name}"


def device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_memory_bytes(device: Any) -> int:
    """The most one process can hold on `device`: a GPU's memory, or this machine's (or its container's limit)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    return machine_memory_bytes()


def check_memory(needed: int, device: Any, what: str, error: type[NanoptError], hint: str) -> None:
    """`error`, one line, when `needed` bytes (a lower bound from nanopt.model.memory, the figures `nanopt estimate`
    prints) exceed all that `device` holds: said before anything is allocated, not as an allocator traceback or the
    out-of-memory killer's SIGKILL partway through."""
    available = device_memory_bytes(device)
    if needed > available:
        where = (f"the {_gib(available)} of {device_name(device)}" if device.type == "cuda"
                 else f"this machine's {_gib(available)} of memory")
        raise error(f"{what} take at least {_gib(needed)}, more than {where}", hint)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


class MemoryProbe:
    """Peak memory, as nanopt reports it everywhere (train metrics, profile, find-batch, and what the memory model
    of nanopt.model.memory predicts): on CUDA the caching allocator's peak reserved bytes plus the CUDA context (or
    the device's used memory when read, if larger), i.e. what the process holds on the device and what decides an
    out-of-memory error; on the CPU the process's
    peak resident set size (VmHWM, which Linux lets a process reset through /proc/self/clear_refs).

    Reserved, not allocated: the allocator keeps freed blocks for reuse, and they count against the device's
    memory as much as live tensors do. `gpu_memory` caps the device as if it had that many bytes."""

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
            # Or what the device has lost now, if more: memory taken outside the caching allocator since the probe
            # was made (cuBLAS and cuDNN handles and workspaces, kernels loaded on first use) is in neither term.
            free, total = torch.cuda.mem_get_info(self.device)
            return max(int(torch.cuda.max_memory_reserved(self.device)) + self.context_bytes, total - free)
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
