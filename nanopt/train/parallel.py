"""Applied to a built model: activation checkpointing, FSDP2 or DDP, torch.compile; and its state dicts, full or
sharded.

The model module stays pure; everything about devices and ranks happens here. `Prepared.raw` is the
unwrapped module (FSDP2 shards it in place), whose parameter names are the checkpoint's keys.
"""

from __future__ import annotations

import contextlib
import functools
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
from torch.utils.checkpoint import checkpoint

from nanopt.config import TrainConfig
from nanopt.runtime import Runtime
from nanopt.train.optim import MuonWithAdamW, optimizers_of

FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL = StateDictOptions(full_state_dict=True)


@dataclass
class Prepared:
    model: torch.nn.Module  # call this for the forward pass (maybe DDP- and compile-wrapped)
    raw: torch.nn.Module  # parameters and state dicts
    ddp: torch.nn.Module | None
    fsdp: bool
    compiled: bool

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


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward; parameter names stay unchanged."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed_forward, block.forward)


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def prepare(model: torch.nn.Module, rt: Runtime, cfg: TrainConfig) -> Prepared:
    model.to(rt.device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    ddp = None
    fsdp = cfg.parallelism == "fsdp" and rt.distributed
    wrapped: torch.nn.Module = model
    if fsdp:
        _shard(model, rt)
    elif rt.distributed:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
                                      gradient_as_bucket_view=True)
        wrapped = ddp
    compiled = resolve_compile(cfg.compile, rt.device)
    if compiled:
        wrapped = torch.compile(wrapped)
    return Prepared(model=wrapped, raw=model, ddp=ddp, fsdp=fsdp, compiled=compiled)


def _shard(model: torch.nn.Module, rt: Runtime) -> None:
    """FSDP2: one unit per transformer block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if rt.autocast_dtype is not None:
        # Gather parameters in bf16 (half the traffic), reduce gradients in fp32 for accuracy.
        policy = MixedPrecisionPolicy(param_dtype=rt.autocast_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


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
    set_optimizer_state_dict(prepared.raw, optimizers_of(optimizer), optim_state_dict=state, options=FULL)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for each parameter registered under a second name (tied input and output embeddings): a
    checkpoint stores it once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def sharded_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW) -> dict[str, Any]:
    """{"model": ..., "optimizer": ...} as each rank holds them: FSDP2's DTensor shards (DDP: the replicated
    tensors), keyed by parameter name, tied aliases left out. No collective for the weights; a fresh optimizer's
    state is created (zeros) so that the dict can also serve as the template a checkpoint is loaded into."""
    aliases = tied_aliases(prepared.raw)
    model = {k: v for k, v in get_model_state_dict(prepared.raw).items() if k not in aliases}
    return {"model": model, "optimizer": get_optimizer_state_dict(prepared.raw, optimizers_of(optimizer))}


def load_sharded_state(prepared: Prepared, optimizer: torch.optim.Optimizer | MuonWithAdamW,
                       state: dict[str, Any]) -> None:
    """Put back a `sharded_state` dict (filled from a checkpoint) into the model and optimizer."""
    model = dict(state["model"])
    for alias, name in tied_aliases(prepared.raw).items():
        model[alias] = model[name]
    set_model_state_dict(prepared.raw, model)
    set_optimizer_state_dict(prepared.raw, optimizers_of(optimizer), optim_state_dict=state["optimizer"])
