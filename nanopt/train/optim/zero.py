"""ZeRO-1 (train.json's `"parallelism": "zero1"`): DDP with the optimizer state sharded across the ranks by
torch.distributed.optim.ZeroRedundancyOptimizer, and its state in the same checkpoint format as every other layout.

ZeroRedundancyOptimizer gives each rank a plain AdamW (`.optim`) over the parameters it owns, steps it, and
broadcasts the updated parameters. Its own state_dict gathers the whole state on one rank, which is what nanopt's
checkpoints avoid, and torch.distributed.checkpoint's state-dict functions refuse its partitions (a rank may own no
parameter of a group). So the state goes through here: keyed by parameter name as get_optimizer_state_dict keys
it, each rank holding only the entries of the parameters it owns, the parameter groups listing every parameter
(meta.json's optimizer_param_groups, as a DDP run writes them). A checkpoint written by DDP, FSDP2 or ZeRO-1 on any
world size then loads here, each rank taking the entries of its own parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

PARAMS = "params"


def build_zero_adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                     fused: bool) -> ZeroRedundancyOptimizer:
    """AdamW over `groups` (decay and no-decay), its state sharded across the default process group's ranks."""
    return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=lr, betas=betas, eps=eps,
                                   fused=fused, foreach=None if fused else True)


def _names(model: torch.nn.Module) -> dict[int, str]:
    # remove_duplicate: a tied weight is one parameter with one (its first) name, as DSD names it.
    return {id(p): name for name, p in model.named_parameters()}


def zero_state_dict(model: torch.nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """{"state": {name: {state name: tensor}} for this rank's parameters (created as zeros before the first step, so
    the dict can serve as the template a checkpoint is loaded into), "param_groups": every group with every name}."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(zero.optim)  # what get_optimizer_state_dict does: a step with zero gradients and LR 0
    names = _names(model)
    state = {names[id(param)]: dict(entry) for param, entry in zero.optim.state.items()}
    groups = [{**_settings(local), PARAMS: [names[id(p)] for p in whole[PARAMS]]}
              for local, whole in zip(zero.optim.param_groups, zero.param_groups, strict=True)]
    return {"state": state, "param_groups": groups}


def load_zero_state_dict(model: torch.nn.Module, zero: ZeroRedundancyOptimizer, state: dict[str, Any]) -> None:
    """Load a state keyed by parameter name (any layout's, whole or this rank's part): each rank takes the entries
    of the parameters it owns, through torch's own Optimizer.load_state_dict (which moves them to the parameter's
    device and dtype)."""
    names = _names(model)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(zero.optim.param_groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} optimizer groups, this optimizer "
                         f"{len(zero.optim.param_groups)}")
    local_state, local_groups, index = {}, [], 0
    for saved, local in zip(saved_groups, zero.optim.param_groups, strict=True):
        ids = []
        for param in local[PARAMS]:
            entry = state["state"].get(names[id(param)])
            if entry is not None:
                local_state[index] = entry
            ids.append(index)
            index += 1
        local_groups.append({**_settings(saved), PARAMS: ids})
    zero.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    for whole, local in zip(zero.param_groups, zero.optim.param_groups, strict=True):
        whole.update(_settings(local))  # ZeRO copies its own groups' settings into the local ones at each step


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != PARAMS}
