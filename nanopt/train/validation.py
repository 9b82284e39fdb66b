"""Held-out loss over a split, computed on every rank and all-reduced, so ranks always agree.

The batches come from nanopt.data.loaders.loader.eval_batches: the same evaluated tokens on any number of ranks and any
micro-batch size, dealt out so that every rank runs the same number of forward passes (a sharded model's forward
pass is a collective). Targets equal to IGNORE_INDEX (padding) are run but not scored, and the only collective
here is one all-reduce after the last batch, so no rank can reach a collective that another skips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from nanopt.model.loss import IGNORE_INDEX
from nanopt.runtime import Runtime, all_reduce_sum_


@dataclass(frozen=True)
class LossResult:
    loss: float  # mean nats per scored token over all ranks
    tokens: int  # targets scored over all ranks

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, rt: Runtime,
                  batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> LossResult:
    """Token-weighted mean cross-entropy over the scored targets of every rank's batches."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # (sum of losses x tokens, tokens)
    for inputs, targets in batches:
        scored = int((targets != IGNORE_INDEX).sum())  # on the CPU tensor: no device sync
        inputs = inputs.to(rt.device, non_blocking=True)
        targets = targets.to(rt.device, non_blocking=True)
        with rt.autocast():
            loss = model(inputs, targets)  # the mean over scored targets; NaN (0 / 0) for a batch of padding
        if scored:  # a batch of padding still ran its forward pass, for the collectives inside a sharded model
            totals[0] += loss.double() * scored
            totals[1] += scored
    all_reduce_sum_(rt, totals)
    model.train(was_training)
    tokens = int(totals[1].item())
    return LossResult(loss=float(totals[0].item()) / max(tokens, 1), tokens=tokens)


def evaluate_by_source(model: torch.nn.Module, rt: Runtime, batches: Any,
                       track: Callable[[Any], Iterable[Any]] = iter) -> tuple[LossResult, dict[str, Any]]:
    """evaluate_loss, and for a mixture's batches (nanopt.data.mixtures.mixture.MixtureEvalBatches) each source's loss
    too: (the loss over all, {"sources": {name: {"val_loss", "val_tokens"}}}), the first the token-weighted mean of the
    sources' losses. One dataset: (its loss, {}). `track` wraps each source's batches (a progress bar)."""
    parts = getattr(batches, "parts", None)
    if parts is None:
        return evaluate_loss(model, rt, track(batches)), {}
    results = {name: evaluate_loss(model, rt, track(part)) for name, part in parts}
    tokens = sum(result.tokens for result in results.values())
    loss = sum(result.loss * result.tokens for result in results.values()) / max(tokens, 1)
    sources = {name: {"val_loss": result.loss, "val_tokens": result.tokens} for name, result in results.items()}
    return LossResult(loss=loss, tokens=tokens), {"sources": sources}
