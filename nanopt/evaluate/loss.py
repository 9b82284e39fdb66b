"""Held-out loss over a split, computed on every rank and all-reduced, so ranks always agree.

The number of batches is decided before any rank starts (the loader gives every rank the same count), so no
rank can reach a collective that another skips.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nanopt.runtime import Runtime, all_reduce_sum_


@dataclass(frozen=True)
class LossResult:
    loss: float  # mean nats per token over all ranks
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, rt: Runtime,
                  batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> LossResult:
    """Token-weighted mean cross-entropy over this rank's batches, summed over all ranks."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # (sum of losses x tokens, tokens)
    for inputs, targets in batches:
        inputs = inputs.to(rt.device, non_blocking=True)
        targets = targets.to(rt.device, non_blocking=True)
        with rt.autocast():
            loss = model(inputs, targets)
        count = targets.numel()
        totals[0] += loss.double() * count
        totals[1] += count
    all_reduce_sum_(rt, totals)
    model.train(was_training)
    tokens = int(totals[1].item())
    return LossResult(loss=float(totals[0].item()) / max(tokens, 1), tokens=tokens)
