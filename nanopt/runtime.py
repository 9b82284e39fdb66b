"""Where and how a process runs: device, dtype, seeding, the torchrun environment and process groups.

Every collective helper here is entered by every rank; callers never put them behind a rank-dependent `if`.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nanopt.errors import ConfigError

# A rank that waits longer than this at a collective is told so instead of hanging until the job is killed.
DEFAULT_PG_TIMEOUT_S = int(os.environ.get("NANOPT_PG_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    local_rank: int
    world_size: int
    precision: str  # "bf16" or "fp32", resolved from "auto"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)


def torchrun_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from the variables torchrun sets; (0, 0, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return "bf16" if bf16_ok else "fp32"
    if requested == "fp16":
        raise ConfigError("train.json: key 'precision': fp16 is not supported (it needs loss scaling)",
                          "use \"bf16\" (Ampere or newer) or \"fp32\"")
    return requested


def init_runtime(precision: str = "auto", timeout_s: int = DEFAULT_PG_TIMEOUT_S) -> Runtime:
    """Pick the device, join the process group under torchrun (NCCL on CUDA, gloo on the CPU)."""
    rank, local_rank, world = torchrun_env()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return Runtime(device=device, rank=rank, local_rank=local_rank, world_size=world,
                   precision=resolve_precision(precision, device))


def quiesce(rt: Runtime) -> None:
    """A last barrier, entered by every rank together, before the process group is torn down.

    Gloo's worker thread frees a finished collective's tensors after the caller has moved on, and needs the GIL to
    do so; if the process group's destructor (run with the GIL held, e.g. when the DDP model is freed) joins that
    thread first, the process hangs at exit and torchrun waits for it. After a barrier no such work is pending.
    """
    if rt.distributed and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:  # a peer is already gone; the outcome is decided, nothing left to protect
            pass


def shutdown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------------------- RNG state as JSON


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, JSON-serializable (no pickle in checkpoints)."""
    np_state = np.random.get_state()
    state = {"python": [list(s) if isinstance(s, tuple) else s for s in random.getstate()],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "torch": _b64(torch.get_rng_state()), "cuda": None}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# --------------------------------------------------------------------------------------------- collectives


def all_reduce_max(rt: Runtime, value: float) -> float:
    """The maximum of a scalar over ranks: how every rank reaches the same decision (stop, skip, save)."""
    if not rt.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum_(rt: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(rt: Runtime, obj: Any) -> list[Any]:
    if not rt.distributed:
        return [obj]
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(rt: Runtime, obj: Any) -> Any:
    """Rank 0's value on every rank."""
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def rank0_print(rt: Runtime, *args: Any) -> None:
    if rt.is_main:
        print(*args, file=sys.stderr, flush=True)


@contextlib.contextmanager
def main_process_first(rt: Runtime) -> Iterator[None]:
    """Rank 0 does the work first (e.g. creating a directory); the others follow after a barrier."""
    if not rt.is_main:
        barrier(rt)
    yield
    if rt.is_main:
        barrier(rt)
