"""The health signals measured on the device, at log steps only (nanopt.train.health.verdicts judges them).

On a step whose record will be logged, the step asks the probe for
- the gradient norm of each block (`embed_tokens`, `layers.N`, `norm`, `lm_head` when untied), before clipping:
  one fused norm over the gradients (torch._foreach_norm), summed per block;
- the update-to-parameter norm ratio of each optimizer group (`decay`, `no_decay`, and `muon` for Muon's
  matrices): ||p after - p before|| / ||p after||, from a copy of the parameters taken just before
  optimizer.step(), on that step only, and freed after it: one step in `log_interval` copies the parameters once.
Under FSDP2 every rank holds a shard (a DTensor's local rows): each rank sums the squares of its own, and one
all-reduce on that step, entered by every rank (the log step is the same everywhere), makes them global. Under DDP
the gradients, after their all-reduce, and the parameters are the same on every rank: nothing to reduce. One host
sync reads them all, after the optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanopt.runtime import all_reduce_sum_

GROUP_NAMES = ("decay", "no_decay", "muon")  # the optimizer's param groups in build_optimizer's order


def block_of(name: str) -> str:
    """`layers.3.attn.q_proj.weight` -> `layers.3`, `embed_tokens.weight` -> `embed_tokens`; wrapper modules'
    private names (activation checkpointing's `_checkpoint_wrapped_module`, compile's `_orig_mod`) are skipped."""
    parts = [part for part in name.split(".") if not part.startswith("_")]
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class HealthProbe:
    """Measures one log step: `gradients()` before clipping, `before_update()` and `after_update()` around the
    optimizer step (not on a skipped one), then `read()` once. Every rank calls the same methods at the same step."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, rt: Any) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # tied weights: once
        self.params = [p for _, p in named]
        self.blocks = list(dict.fromkeys(block_of(name) for name, _ in named))
        group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.groups = [GROUP_NAMES[i] for i in range(len(optimizer.param_groups))]
        self.block_index = torch.tensor([self.blocks.index(block_of(name)) for name, _ in named])
        self.group_index = torch.tensor([group_of.get(id(p), 0) for p in self.params])
        self.sharded = any(hasattr(p, "to_local") for p in self.params)
        self.rt = rt
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._reset()

    def _reset(self) -> None:
        self.grad_squares: torch.Tensor | None = None
        self.update_squares: torch.Tensor | None = None
        self.param_squares: torch.Tensor | None = None
        self.snapshot: list[torch.Tensor] | None = None

    @torch.no_grad()
    def gradients(self) -> None:
        with_grads = [i for i, p in enumerate(self.params) if p.grad is not None]
        norms = torch._foreach_norm([_local(self.params[i].grad) for i in with_grads])
        self.grad_squares = self._per(self.block_index[with_grads], norms, len(self.blocks))

    @torch.no_grad()
    def before_update(self) -> None:
        self.snapshot = [t.clone() for t in self._locals()]

    @torch.no_grad()
    def after_update(self) -> None:
        if self.snapshot is None:
            return
        current = self._locals()
        torch._foreach_sub_(self.snapshot, current)  # the copy becomes -(the update), in place: no second copy
        self.update_squares = self._per(self.group_index, torch._foreach_norm(self.snapshot), len(self.groups))
        self.param_squares = self._per(self.group_index, torch._foreach_norm(current), len(self.groups))
        self.snapshot = None

    def read(self) -> dict[str, Any]:
        """The step's signals as record fields: one all-reduce (FSDP2) and one host sync. Before read the probe is
        reset, so a step that measured nothing (a skipped update) reports no ratio."""
        measured = self.update_squares is not None
        zeros = torch.zeros(len(self.groups), device=self.device)
        grads = self.grad_squares
        if grads is None:
            grads = torch.zeros(len(self.blocks), device=self.device)
        parts = torch.cat([grads, *((self.update_squares, self.param_squares) if measured else (zeros, zeros))])
        if self.sharded:
            all_reduce_sum_(self.rt, parts)
        values = parts.double().sqrt().tolist()
        self._reset()
        blocks, rest = values[:len(self.blocks)], values[len(self.blocks):]
        updates, params = rest[:len(self.groups)], rest[len(self.groups):]
        fields: dict[str, Any] = {"grad_norm_blocks": dict(zip(self.blocks, blocks, strict=True))}
        if measured:
            fields["update_ratio"] = {name: (u / p if p > 0 else None)
                                      for name, u, p in zip(self.groups, updates, params, strict=True)}
        return fields

    def _locals(self) -> list[torch.Tensor]:
        return [_local(p.detach()) for p in self.params]

    def _per(self, index: torch.Tensor, norms: list[torch.Tensor] | tuple, size: int) -> torch.Tensor:
        """Sums of squared norms per block or group, on the device."""
        out = torch.zeros(size, device=self.device, dtype=torch.float32)
        if len(norms):
            squares = torch.stack([n.float() for n in norms]).square()
            out.index_add_(0, index.to(squares.device), squares)
        return out


def global_norm(blocks: dict[str, float]) -> float:
    """The whole model's gradient norm from the blocks' (the one clipping uses)."""
    return math.sqrt(sum(v * v for v in blocks.values()))
