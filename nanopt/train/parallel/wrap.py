"""Applied to a built model: activation checkpointing, FSDP2 or DDP, torch.compile; and its state dicts, full or
sharded.

train.json's `parallelism`, from the least memory saved to the most (PyTorch's own components throughout):
ddp           DDP: a whole replica of weights, gradients and optimizer state per rank.
zero1         DDP, the optimizer state sharded (torch.distributed.optim.ZeroRedundancyOptimizer:
              nanopt.train.optim.zero).
zero2         FSDP2 keeping each block's gathered weights from forward to backward (reshard_after_forward=False):
              gradients and optimizer state sharded, no second all-gather in backward.
fsdp          FSDP2 (ZeRO-3): weights too sharded, gathered per block in forward and again in backward.
fsdp_offload  FSDP2 with CPUOffloadPolicy: sharded weights, gradients and optimizer state live in host memory,
              copied to the GPU per block; the optimizer steps on the CPU.
On one process every choice trains as DDP's would (nothing to shard across).

The model module stays pure; everything about devices and ranks happens here. `Prepared.raw` is the
unwrapped module (FSDP2 shards it in place), whose parameter names are the checkpoint's keys.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nanopt.config import TrainConfig
from nanopt.model.layout import tied_aliases
from nanopt.model.weight_copies import WeightCopies
from nanopt.runtime import Runtime
from nanopt.train.optim.lowbit import is_adamw8bit, plain_state, quantized_state
from nanopt.train.optim.optimizer import MuonWithAdamW, optimizers_of
from nanopt.train.optim.zero import ZeroRedundancyOptimizer, load_zero_state_dict, zero_state_dict
from nanopt.train.parallel.graphed_step import GraphedMicroStep
from nanopt.train.parallel.recompute import apply_activation_checkpointing
from nanopt.train.precision.fp8 import apply_fp8
from nanopt.train.precision.residual import residual_dtype
from nanopt.train.precision.weight_copies import keep_weight_copies

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)


@dataclass
class Prepared:
    model: torch.nn.Module  # call this for the forward pass (maybe DDP- and compile-wrapped)
    raw: torch.nn.Module  # parameters and state dicts
    ddp: torch.nn.Module | None
    fsdp: bool
    compiled: bool
    graphed: GraphedMicroStep | None = None  # train.json's cuda_graphs (nanopt.train.parallel.graphed_step)
    # train.json's bf16_weight_copies (nanopt.train.precision.weight_copies): refreshed before each step's first
    # micro-batch
    weight_copies: WeightCopies | None = None

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on accumulation micro-steps before the last one."""
        if enabled:
            return contextlib.nullcontext()
        if self.ddp is not None:
            return self.ddp.no_sync()
        if self.fsdp:
            return _fsdp_no_sync(self.raw)
        return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module: torch.nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def resolve_compile(setting: bool | str, device: torch.device) -> bool:
    # On the CPU, compile time dwarfs the short runs people make there; on CUDA it pays for itself.
    return device.type == "cuda" if setting == "auto" else bool(setting)


def prepare(model: torch.nn.Module, rt: Runtime, cfg: TrainConfig) -> Prepared:
    model.to(rt.device)
    # FP8 layers before FSDP2 (its FP8 all-gather) and compile; checked at session start (nanopt.train.precision.fp8).
    # The FP8 all-gather only where FSDP2 keeps the weights on the GPU (fsdp, zero2); offload's gather stays bf16
    # (untested).
    apply_fp8(model, cfg.fp8, rt.world_size if cfg.parallelism in ("fsdp", "zero2") else 1)
    # checked at session start (nanopt.train.precision.residual)
    model.residual_dtype = residual_dtype(cfg.bf16_residual)
    # after FP8's layers (they keep their own GEMMs), before compile and DDP see the model; checked at session start
    copies = keep_weight_copies(model, cfg.bf16_weight_copies, rt.autocast_dtype)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    compiled = resolve_compile(cfg.compile, rt.device)
    if cfg.parallelism in FSDP2_CHOICES and rt.distributed:
        if compiled:
            _compile_blocks(model)  # before sharding: FSDP2's hooks must stay outside the compiled code
        _shard(model, rt, cfg.parallelism)
        return Prepared(model=model, raw=model, ddp=None, fsdp=True, compiled=compiled, weight_copies=copies)
    ddp = None
    wrapped: torch.nn.Module = model
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel

        # broadcast_buffers=False: the only buffers are llama's RoPE tables, the same on every rank by construction;
        # DDP's default would broadcast them from rank 0 before every forward, every micro-batch.
        ddp = DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
                                      gradient_as_bucket_view=True, bucket_cap_mb=ddp_bucket_cap_mb(model),
                                      broadcast_buffers=False)
        wrapped = ddp
    if compiled:
        # One graph for the model and its loss. Static shapes: a new batch shape (an evaluation's) gets a graph of
        # its own instead of turning the training graph's sizes symbolic. Over DDP, Dynamo's DDPOptimizer splits
        # the graph at DDP's bucket boundaries, hence buckets of a layer's size.
        wrapped = torch.compile(wrapped, dynamic=False)
    graphed = GraphedMicroStep(wrapped, list(model.parameters()), rt.autocast) if cfg.cuda_graphs else None
    return Prepared(model=wrapped, raw=model, ddp=ddp, fsdp=False, compiled=compiled, graphed=graphed,
                    weight_copies=copies)


def _compile_blocks(model: torch.nn.Module) -> None:
    """Under FSDP2, compile each block's forward and the final norm, as torchtitan does (apply_compile before
    apply_fsdp). Compiling the whole sharded model instead makes Dynamo meet FSDP2's (uncompilable) hooks inside
    the layer loop and skip the model's frame without a word. Replacing `forward` on the instance keeps every
    parameter's name (a torch.compile wrapper module would prefix them `_orig_mod.`); the blocks share one code
    object, so they share one compiled graph. The embedding and the chunked loss stay eager: they run inside the
    root module's forward, which FSDP2's hooks surround."""
    for block in model.layers:
        block.forward = torch.compile(block.forward, dynamic=False)
    model.norm.forward = torch.compile(model.norm.forward, dynamic=False)


DDP_MIN_BUCKET_MB = 25  # DDP's own default


def ddp_bucket_cap_mb(model: torch.nn.Module) -> int:
    """DDP bucket size (MiB) that holds the gradients of the largest transformer layer, and at least DDP's default.
    Under torch.compile each bucket boundary splits the graph (DDPOptimizer): at 25 MiB a 1B-parameter Llama's
    layer is cut into four subgraphs, each with its own wrapper; a layer per bucket keeps it to about one."""
    layer_bytes = max((sum(p.numel() * p.element_size() for p in block.parameters()) for block in model.layers),
                      default=0)
    return max(DDP_MIN_BUCKET_MB, math.ceil(layer_bytes / 2**20))


FSDP2_CHOICES = ("zero2", "fsdp", "fsdp_offload")


def shards_optimizer_only(cfg: TrainConfig, rt: Runtime) -> bool:
    """ZeRO-1: DDP's replicas, the optimizer state sharded (nanopt.train.optim.zero)."""
    return cfg.parallelism == "zero1" and rt.distributed


def _shard(model: torch.nn.Module, rt: Runtime, choice: str) -> None:
    """FSDP2: one unit per transformer block, then the root (embeddings, final norm, head), with the choice's
    policies (see the module's docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if rt.autocast_dtype is not None:
        # Gather parameters in bf16 (half the traffic), reduce gradients in fp32 for accuracy.
        policy = MixedPrecisionPolicy(param_dtype=rt.autocast_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=rt.device.type == "cuda") if choice == "fsdp_offload" else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=policy, offload_policy=offload, reshard_after_forward=choice != "zero2")
    fully_shard(model, mp_policy=policy, offload_policy=offload)  # the root: FSDP2 keeps it gathered for backward


# ------------------------------------------------------------------------------------------ state dicts


def full_model_state(prepared: Prepared) -> dict[str, torch.Tensor]:
    """Unsharded weights on the CPU. Collective under FSDP: every rank calls it; rank 0 gets the tensors."""
    return get_model_state_dict(prepared.raw, options=FULL_ON_CPU)


def full_optimizer_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW) -> dict[str, Any]:
    """One state keyed by parameter name, whichever torch optimizers (AdamW, or Muon and AdamW) hold it."""
    return get_optimizer_state_dict(prepared.raw, optimizers_of(optimizer), options=FULL_ON_CPU)


def load_full_model_state(prepared: Prepared, state: dict[str, torch.Tensor]) -> None:
    set_model_state_dict(prepared.raw, state, options=FULL)


def load_full_optimizer_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW,
                              state: dict[str, Any]) -> None:
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        load_zero_state_dict(prepared.raw, optimizer, state)  # each rank takes its own parameters' entries
        return
    set_optimizer_state_dict(prepared.raw, optimizers_of(optimizer), optim_state_dict=_live(optimizer, state),
                             options=FULL)


def sharded_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} as each rank holds them: FSDP2's DTensor shards (DDP: the replicated
    tensors), keyed by parameter name, tied aliases left out. No collective for the weights; a fresh optimizer's
    state is created (zeros) so that the dict can also serve as the template a checkpoint is loaded into."""
    aliases = tied_aliases(prepared.raw)
    model = {k: v for k, v in get_model_state_dict(prepared.raw).items() if k not in aliases}
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # ZeRO-1: this rank's parameters' entries
        return {"model": model, "optimizer": zero_state_dict(prepared.raw, optimizer)}
    return {"model": model, "optimizer": _stored(optimizer, get_optimizer_state_dict(prepared.raw,
                                                                                     optimizers_of(optimizer)))}


def load_sharded_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW,
                       state: dict[str, Any]) -> None:
    """Put back a `sharded_state` dict (filled from a checkpoint) into the model and optimizer."""
    model = dict(state["model"])
    for alias, name in tied_aliases(prepared.raw).items():
        model[alias] = model[name]
    set_model_state_dict(prepared.raw, model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        load_zero_state_dict(prepared.raw, optimizer, state["optimizer"])
        return
    set_optimizer_state_dict(prepared.raw, optimizers_of(optimizer),
                             optim_state_dict=_live(optimizer, state["optimizer"]))


def _stored(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state as a checkpoint stores it: 8-bit moments as their plain tensors
    (nanopt.train.optim.lowbit)."""
    return plain_state(state) if is_adamw8bit(optimizer) else state


def _live(optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
    return quantized_state(state) if is_adamw8bit(optimizer) else state
