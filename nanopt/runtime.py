"""Where and how a process runs: device, dtype, seeding, ranks, process groups, and what the device holds.
(The random streams a checkpoint carries are saved and restored by nanopt.rng.)

The only reader of torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE; TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_MAX_RESTARTS in `restarts()`): `ranks()` answers without importing torch, so the CLI can ask which
rank it is on its fast paths. Torch is imported inside the functions that need it for the same reason.

Every collective helper here is entered by every rank; callers never put them behind a rank-dependent `if`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from nanopt.errors import ConfigError, NanoptError
from nanopt.hardware import detect_gpu, machine_memory_bytes

if TYPE_CHECKING:
    import torch

DEFAULT_PG_TIMEOUT_S = 600


def pg_timeout_s() -> int:
    """How long a rank waits at a collective before it is told so instead of hanging until the job is killed."""
    return int(os.environ.get("NANOPT_PG_TIMEOUT_S", str(DEFAULT_PG_TIMEOUT_S)))


class Ranks(NamedTuple):
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks() -> Ranks:
    """This process's place under torchrun; (0, 0, 1) outside it."""
    return Ranks(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ.get("WORLD_SIZE", "1")))


def under_torchrun() -> bool:
    """True inside a worker that torchrun started (the launcher itself sees no WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ


class Restarts(NamedTuple):
    done: int  # how many times torchrun has restarted this worker's group after a failure (0: its first start)
    allowed: int  # --max-restarts

    @property
    def left(self) -> int:
        return max(0, self.allowed - self.done)


def restarts() -> Restarts:
    """Where this worker stands among torchrun's restarts (`--max-restarts`); (0, 0) outside torchrun."""
    return Restarts(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")))


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    precision: str  # "bf16" or "fp32", resolved from "auto"
    tf32: bool = False  # fp32 matmuls and convolutions run on TF32 tensor cores (CUDA, train.json "tf32")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def resolve_precision(requested: str, device: torch.device) -> str:
    import torch

    if requested == "auto":
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if bf16_ok else "fp32"
    if requested == "fp16":
        raise ConfigError("train.json: key 'precision': fp16 is not supported (it needs loss scaling)",
                          "use \"bf16\" (Ampere or newer) or \"fp32\"")
    return requested


ALLOCATOR_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the person's own allocator options, either name


def allocator_settings(environ: Mapping[str, str] | None = None) -> str | None:
    """The CUDA caching allocator options training asks for: expandable segments, which grow a segment in place
    instead of caching blocks of many sizes, so the memory reserved (what decides an out-of-memory error, and what
    nanopt reports as peak memory) stays close to what is allocated; nanochat and modded-nanogpt set the same.
    None when the person set allocator options of their own: theirs apply, untouched."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in ALLOCATOR_ENV):
        return None
    return "expandable_segments:True"


def init_runtime(precision: str = "auto", timeout_s: int | None = None, tf32: bool = True) -> Runtime:
    """Pick the device, join the process group under torchrun (NCCL on CUDA, gloo on the CPU); TF32 per `tf32`."""
    import torch
    import torch.distributed as dist

    rank, local_rank, world = ranks()
    timeout_s = pg_timeout_s() if timeout_s is None else timeout_s
    if torch.cuda.is_available():
        settings = allocator_settings()
        if settings is not None:  # before the first CUDA allocation: segments made earlier would keep the old kind
            torch.cuda.memory._set_allocator_settings(settings)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return with_tf32(Runtime(device=device, rank=rank, local_rank=local_rank, world_size=world,
                             precision=resolve_precision(precision, device)), tf32)


def runtime_on(device: str) -> Runtime:
    """One process on the device a person named ("cpu", "cuda", "cuda:1"), outside torchrun: evaluation beside a
    training that holds the other GPUs. ConfigError, one line, for a name torch does not know or a GPU not here."""
    import torch

    hint = "e.g. --device cpu, --device cuda or --device cuda:1"
    if ranks().world_size > 1:
        raise ConfigError("--device picks one device for one process, and this is one of several ranks",
                          "leave --device out under torchrun (--nproc-per-node > 1)")
    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device!r}: not a device name", hint) from None
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: nanopt evaluates on the CPU or a CUDA GPU", hint)
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if chosen.index is None else chosen.index
        if index >= count:
            raise ConfigError(f"--device {device}: this machine has {count} CUDA GPU(s)", hint)
        chosen = torch.device("cuda", index)
        torch.cuda.set_device(chosen)
    return Runtime(device=chosen, rank=0, local_rank=0, world_size=1, precision=resolve_precision("auto", chosen))


def with_tf32(rt: Runtime, enabled: bool) -> Runtime:
    """`rt` with CUDA's fp32 matmuls and convolutions on TF32 tensor cores, or in true fp32 (train.json "tf32").
    Legacy flags only, set nowhere else: torch 2.9+ reads them back through fp32_precision too, but raises on a "mix
    of the legacy and new APIs" (inside Inductor too) if per-backend fp32_precision values are set beside them."""
    if rt.device.type != "cuda":
        return rt
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    return dataclasses.replace(rt, tf32=enabled)


def new_cpu_group(rt: Runtime) -> Any:
    """A gloo process group over all ranks, for work on host memory beside the training collectives (a checkpoint
    written in the background): its collectives never interleave with the training group's. A collective: every
    rank calls it at the same point. None in a single process."""
    if not rt.distributed:
        return None
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=pg_timeout_s()))


def quiesce(rt: Runtime) -> None:
    """A last barrier, entered by every rank together, before the process group is torn down.

    Gloo's worker thread frees a finished collective's tensors after the caller has moved on, and needs the GIL to
    do so; if the process group's destructor (run with the GIL held, e.g. when the DDP model is freed) joins that
    thread first, the process hangs at exit and torchrun waits for it. After a barrier no such work is pending.
    """
    import torch.distributed as dist

    if rt.distributed and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer is already gone; the outcome is decided, nothing left to protect
            pass


def shutdown(rt: Runtime) -> None:
    import torch.distributed as dist

    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------- collectives


def all_reduce_max(rt: Runtime, value: float) -> float:
    """The maximum of a scalar over ranks: how every rank reaches the same decision (stop, skip, save)."""
    if not rt.distributed:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum_(rt: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(rt: Runtime, obj: Any) -> list[Any]:
    if not rt.distributed:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(rt: Runtime, obj: Any) -> Any:
    """Rank 0's value on every rank."""
    if not rt.distributed:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        import torch.distributed as dist

        dist.barrier()


# ------------------------------------------------------------------------------------- what the device holds


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
