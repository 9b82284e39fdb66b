"""Where and how a process runs: device, dtype, its CPU threads (chosen by nanopt.cpu_threads), seeding, ranks,
process groups, and what the device holds.
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

from nanopt.cpu_threads import CPUThreads, set_cpu_threads
from nanopt.errors import ConfigError

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
    # "bf16", "fp16" (CUDA only, with loss scaling: nanopt.train.precision.scaling) or "fp32", from "auto"
    precision: str
    tf32: bool = False  # fp32 matmuls and convolutions run on TF32 tensor cores (CUDA, train.json "tf32")
    cpu_threads: CPUThreads | None = None  # on the CPU: torch's intra-op threads, and why (init_runtime)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def resolve_precision(requested: str, device: torch.device) -> str:

    if requested == "auto":  # bf16 where the GPU has it, fp16 on GPUs without (T4, V100), fp32 on the CPU
        if device.type != "cuda":
            return "fp32"
        return "bf16" if _has_bf16() else "fp16"
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError("train.json: key 'precision': fp16 needs a CUDA GPU (fp16 autocast with dynamic loss "
                          "scaling); this process trains on the CPU", "use \"fp32\" or \"auto\" on the CPU")
    return requested


def _has_bf16() -> bool:
    """bf16 in hardware: torch's check counts emulation as support by default (a T4 would then run bf16 slowly)."""
    import inspect

    import torch

    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.is_bf16_supported()


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
        device = torch.device("cuda", _device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    threads = None
    if device.type == "cpu":
        if world > 1:  # every rank, whatever its environment: the ranks then sample idle, none counts another's work
            dist.barrier()
        threads = set_cpu_threads()
    return with_tf32(Runtime(device=device, rank=rank, local_rank=local_rank, world_size=world,
                             precision=resolve_precision(precision, device), cpu_threads=threads), tf32)


def _device_index(local_rank: int, visible: int) -> int:
    """The GPU a rank uses: its local rank, except where it sees one GPU only. SLURM's --gpus-per-task (or
    --gpu-bind) gives each task of srun its own GPU, then the only one it sees, whatever its local rank."""
    return 0 if visible == 1 else local_rank


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
    return Runtime(device=chosen, rank=0, local_rank=0, world_size=1, precision=resolve_precision("auto", chosen),
                   cpu_threads=set_cpu_threads() if chosen.type == "cpu" else None)


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
