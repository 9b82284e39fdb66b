"""`"optimizer": "adamw8bit"`: AdamW with its two moments in 8 bits (torchao.optim.AdamW8bit: block-wise dynamic
quantization, a scale per 256 values), about 2 bytes a parameter for the moments instead of 8. torchao is an extra:
`pip install 'nanopt[lowbit]'`. It runs on the CPU and on CUDA (its step is compiled with torch.compile on first
use: a few seconds on a CPU), under DDP and under FSDP2 (zero2, fsdp, fsdp_offload), where each rank quantizes and
steps its own rows of a parameter (the moments are DTensors as torchao makes them; the step is given each rank's
shard as plain tensors: see `step_own_shards`).

Which moments are 8-bit (`quantizes`): a tensor of 4096 values or more whose rows (dim 0, the dimension FSDP2
shards) come in groups of whole 256-value blocks, `rows_per_block_group` rows each, with every rank's shard a
non-empty number of such groups. On one process or DDP that is torchao's own rule (4096 values or more, a multiple of
256); under FSDP2 it keeps every block inside one rank's rows, so the blocks, codes and scales are the same
whatever the world size (bar shapes that do not split evenly: those stay fp32 on that many ranks). Smaller
tensors (norms, biases) keep fp32 moments.

A quantized moment is a tensor subclass (OptimState8bit) that neither safetensors nor torch.distributed.checkpoint
store; in a checkpoint it is its three plain tensors, `<parameter>/exp_avg_codes` (uint8, the parameter's shape),
`exp_avg_scale` (fp32, one per block, shaped [row groups, blocks per group] so that it shards by rows as the
parameter does) and `exp_avg_qmap` (fp32, the 256-entry code book; no dots: sharded checkpoints join names with
them), rebuilt bit for bit on load, so a resumed run continues exactly, on any number of ranks and any layout.
Whether a moment is signed follows from its name (the first moment is, the second is not), as torchao creates them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from nanopt.errors import CheckpointError, ConfigError

PARTS = ("codes", "scale", "qmap")
PART_DTYPES = {"codes": "uint8", "scale": "float32", "qmap": "float32"}
CODES = 256  # entries of the code book: one per 8-bit code
SIGNED = {"exp_avg": True, "exp_avg_sq": False}
BLOCK = 256  # values per scale: torchao's AdamW8bit default
MIN_VALUES = 4096  # smaller tensors keep fp32 moments (torchao's and bitsandbytes' threshold)


def build_adamw8bit(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise ConfigError("train.json: \"optimizer\": \"adamw8bit\" needs torchao, which is not installed",
                          "pip install 'nanopt[lowbit]' (torchao 0.18 or later), or use \"optimizer\": \"adamw\"") \
            from None

    class ShardAlignedAdamW8bit(AdamW8bit):
        """torchao's AdamW8bit, its moments made by `new_moment` (whole blocks in every rank's rows), each rank
        stepping its own shard (`step_own_shards`)."""

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return new_moment(p, signed)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"]):
                step_own_shards(self)
            else:  # one process or DDP: plain tensors already, torchao's own step
                super().step()
            return loss

    return ShardAlignedAdamW8bit(groups, lr=lr, betas=betas, eps=eps, block_size=BLOCK)


def step_own_shards(optimizer: Any) -> None:
    """torchao's AdamW8bit step (its compiled `single_param_adam`, one parameter at a time; AdamW, no amsgrad, as
    build_adamw8bit makes it) on each rank's own shard as plain tensors, where torchao passes FSDP2's DTensors.

    The update is elementwise, so a shard's step is the same arithmetic. What changes is the key of torch.compile's
    on-disk cache (AOTAutograd's, shared by every process of the user): it keys a DTensor by its global shape and
    layout only, not by this rank's shard (pytorch/pytorch#188390). Where FSDP2 gives one rank a row more than
    another (torch.chunk: 257 rows on 2 ranks are 129 + 128), a rank that found the other's entry ran a graph
    compiled for the other shard and died on its first step ("expected size 128==129"), leaving the other ranks
    waiting in their next collective; a resume failed the same way every time. A plain tensor is keyed by its own
    shape, dtype and device. It follows torchao 0.18's step loop; on one process and under DDP (plain tensors
    already) torchao's own step runs instead."""
    from torchao.optim.adam import single_param_adam

    compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    with torch._dynamo.utils.disable_cache_limit():  # as torchao: one graph per shape of parameter, a fixed number
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = optimizer.state[param]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=new_moment(param, signed=True),
                                 exp_avg_sq=new_moment(param, signed=False))
                state["step"] += 1
                compiled(_local(param.detach()), _local(param.grad), state["step"], _local(state["exp_avg"]),
                         _local(state["exp_avg_sq"]), None, group["lr"], beta1, beta2, group["weight_decay"],
                         group["eps"], True, False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view: updating it updates the DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_adamw8bit(optimizer: Any) -> bool:
    return any(cls.__name__ == "AdamW8bit" for cls in type(optimizer).__mro__)  # torchao's, imported on demand


def rows_per_block_group(shape: tuple[int, ...]) -> int:
    """The fewest rows (dim 0) whose values fill whole 256-value blocks: 1 when a row holds a multiple of 256."""
    row = math.prod(shape[1:])
    return BLOCK // math.gcd(row, BLOCK)


def stored_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The shape of each stored part of an 8-bit moment of a parameter of `shape` (one that `quantizes`): the codes
    the parameter's, the scales [row groups, blocks per group], the code book one entry per code."""
    groups = shape[0] // rows_per_block_group(shape)
    return {"codes": tuple(shape), "scale": (groups, math.prod(shape) // BLOCK // groups), "qmap": (CODES,)}


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of each rank's shard along dim 0, as FSDP2 splits them (torch.chunk: ceil(rows / world) each)."""
    size = -(-rows // world)
    return [max(0, min(size, rows - rank * size)) for rank in range(world)]


def quantizes(shape: tuple[int, ...], world: int = 1) -> bool:
    """Whether a moment of a parameter of `shape`, sharded by rows over `world` ranks, is 8-bit (see above)."""
    if not shape or math.prod(shape) < MIN_VALUES:
        return False
    group = rows_per_block_group(shape)
    return all(rows > 0 and rows % group == 0 for rows in shard_rows(shape[0], world))


def _world(param: torch.Tensor) -> int:
    if not isinstance(param, DTensor):
        return 1
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"8-bit AdamW expects parameters sharded by rows over one 1-D mesh (FSDP2), got "
                         f"{param.placements}")
    return param.device_mesh.size()


def new_moment(param: torch.Tensor, signed: bool) -> torch.Tensor:
    """A zero moment for `param`: 8-bit when `quantizes`, else fp32; a DTensor laid out as `param` for FSDP2's."""
    from torchao.optim.subclass_8bit import OptimState8bit

    local = param.to_local() if isinstance(param, DTensor) else param
    if quantizes(tuple(param.shape), _world(param)):
        moment = OptimState8bit.zeros(local.shape, signed, BLOCK, local.device, dtype=local.dtype)
    else:
        moment = torch.zeros_like(local)
    return _like(param, moment)


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as this rank's part of a tensor laid out as `param` (itself when `param` is no DTensor). DTensor
    moves a local tensor to its mesh's device type; under CPU offload the moment belongs with the parameter, on the
    CPU (as torchao does)."""
    if not isinstance(param, DTensor):
        return local
    wrapped = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                 stride=param.stride())
    return wrapped.to(local.device)


def _is_quantized(value: Any) -> bool:
    local = value.to_local() if isinstance(value, DTensor) else value
    return torch.is_tensor(local) and all(hasattr(local, part) for part in PARTS) and type(local) is not torch.Tensor


def _stored_parts(moment: torch.Tensor) -> dict[str, torch.Tensor]:
    """An 8-bit moment as the checkpoint stores it: codes laid out as the parameter, scales shaped [row groups,
    blocks per group] and laid out by rows the same way, the code book as a plain (replicated) tensor."""
    local = moment.to_local() if isinstance(moment, DTensor) else moment
    group = rows_per_block_group(tuple(moment.shape))
    per_group = local.scale.numel() * group // local.shape[0]
    scale = local.scale.view(local.shape[0] // group, per_group)
    if not isinstance(moment, DTensor):
        return {"codes": local.codes, "scale": scale, "qmap": local.qmap}
    mesh, placements, device = moment.device_mesh, moment.placements, local.codes.device
    scale_shape = (moment.shape[0] // group, per_group)
    # Back to the moment's device: DTensor moves a local tensor to its mesh's (CPU offload keeps it on the CPU).
    return {"codes": DTensor.from_local(local.codes, mesh, placements, run_check=False, shape=moment.shape,
                                        stride=moment.stride()).to(device),
            "scale": DTensor.from_local(scale, mesh, placements, run_check=False, shape=scale_shape,
                                        stride=(per_group, 1)).to(device),
            "qmap": local.qmap}


def _rebuilt(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """The reverse of _stored_parts: torchao's tensor (wrapped as a DTensor laid out as the codes under FSDP2)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    local_codes = codes.to_local() if isinstance(codes, DTensor) else codes
    local_scale = scale.to_local() if isinstance(scale, DTensor) else scale
    return _like(codes, OptimState8bit(local_codes, local_scale.reshape(-1), qmap, signed))


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict ({"state": {name: {state name: tensor}}, "param_groups"}) with every quantized moment
    as its plain tensors and the learning rate (a tensor in torchao's groups) a number, as meta.json holds it."""
    entries = {}
    for name, entry in state["state"].items():
        plain = {}
        for key, value in entry.items():
            if _is_quantized(value):
                plain.update({f"{key}_{part}": tensor for part, tensor in _stored_parts(value).items()})
            else:
                plain[key] = value
        entries[name] = plain
    groups = [{**group, "lr": float(group["lr"])} for group in state["param_groups"]]
    return {**state, "state": entries, "param_groups": groups}


def quantized_state(state: dict[str, Any]) -> dict[str, Any]:
    """The reverse of plain_state: each moment stored as codes, scale and code book becomes torchao's tensor."""
    entries = {}
    for name, entry in state["state"].items():
        stored = {f"{moment}_{part}" for moment in SIGNED for part in PARTS}
        rebuilt = {key: value for key, value in entry.items() if key not in stored}
        for moment, signed in SIGNED.items():
            if f"{moment}_codes" in entry:
                rebuilt[moment] = _rebuilt(*(entry[f"{moment}_{part}"] for part in PARTS), signed)
        entries[name] = rebuilt
    groups = [{**group, "lr": torch.tensor(float(group["lr"]))} for group in state["param_groups"]]
    return {**state, "state": entries, "param_groups": groups}


def check_stored_moments(template: dict[str, Any], stored: set[str], where: str, world: int) -> None:
    """CheckpointError, before anything is read, when a moment this run holds in 8 bits is stored in fp32 or the
    reverse: a shape whose rows split into whole blocks on the world size that wrote the checkpoint but not on
    `world` ranks (or the reverse), whose blocks cannot be dealt out to these shards. `template`: the optimizer
    part of a sharded state's tensors ({"state": {parameter: {name: tensor}}}); `stored`: the checkpoint's keys."""
    for name, entry in template["state"].items():
        for moment in SIGNED:
            held_8bit = f"{moment}_codes" in entry
            if not (held_8bit or moment in entry):
                continue
            if f"optimizer.state.{name}.{moment}{'_codes' if held_8bit else ''}" not in stored:
                raise CheckpointError(
                    f"{where}: the 8-bit AdamW {moment} of '{name}' is stored "
                    f"{'in fp32' if held_8bit else 'in 8 bits'}, and {world} rank(s) hold it "
                    f"{'in 8 bits' if held_8bit else 'in fp32'} (its rows split into whole 256-value blocks on one "
                    "world size and not on the other)", "resume on the number of ranks that wrote the checkpoint, "
                    "or on one that splits every parameter's rows evenly")
