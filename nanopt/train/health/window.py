"""Run health's measurements of spans of steps (nanopt.train.health.verdicts judges them): blocks of every step's loss
and gradient norm, and bins of the update ratios measured at log steps.

Both are cut on one grid of `block_steps` consecutive steps (steps 1..B, B+1..2B, ...), which depends on the run's
length only: never on how often it logs, so neither does any verdict read from them. A block keeps sums and order
statistics, not the steps themselves, and a window of ten blocks is judged from those: its loss's mean and
variance exactly, its gradient norm as the median of the blocks' medians (a robust level: one spike moves it
little, a sustained rise moves it all).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from nanopt.parsing import INT64_MAX

MATRIX_GROUPS = ("decay", "muon")  # the weight matrices' groups (nanopt.train.health.probe names them)


@dataclass(frozen=True)
class Block:
    """The steps first..last (those trained: `steps`) of one span of the grid."""

    first: int
    last: int
    steps: int
    losses: int  # the finite losses among them, and their sum and sum of squares
    loss_sum: float
    loss_squares: float
    norm_median: float  # of the steps' gradient norms before clipping; a non-finite norm counts as infinite
    norm_max: float
    clipped: int  # steps whose norm was over grad_clip

    @classmethod
    def of(cls, samples: list[tuple[int, float, float]], grad_clip: float) -> Block:
        """The block of (step, loss, gradient norm) samples, in step order."""
        losses = [loss for _, loss, _ in samples if finite(loss)]
        norms = sorted(norm if finite(norm) else math.inf for _, _, norm in samples)
        clipped = sum(grad_clip < norm < math.inf for norm in norms) if grad_clip > 0 else 0  # overflows: skipped
        return cls(samples[0][0], samples[-1][0], len(samples), len(losses), math.fsum(losses),
                   math.fsum(loss * loss for loss in losses), statistics.median(norms), norms[-1], clipped)

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, value: Any) -> Block | None:
        """The block a train record's `health_blocks` holds, or None when it is not one nanopt wrote."""
        if not isinstance(value, dict) or set(value) != set(cls.__dataclass_fields__):
            return None
        counts = [value[k] for k in ("first", "last", "steps", "losses", "clipped")]
        numbers = [value[k] for k in ("loss_sum", "loss_squares", "norm_median", "norm_max")]
        if not all(type(c) is int and 0 <= c <= INT64_MAX for c in counts) or not all(_real(x) for x in numbers):
            return None
        block = cls(**value)
        consistent = 1 <= block.first <= block.last and block.losses <= block.steps and block.clipped <= block.steps
        return block if consistent and 1 <= block.steps and finite(block.loss_sum + block.loss_squares) else None

    @property
    def middle(self) -> float:
        return (self.first + self.last) / 2


@dataclass(frozen=True)
class WindowStats:
    """What one window of blocks saw."""

    first: int
    last: int
    blocks: int
    losses: int
    loss_mean: float | None
    loss_variance: float | None
    norm_median: float
    clipped_share: float

    @classmethod
    def of(cls, blocks: list[Block]) -> WindowStats:
        losses = sum(b.losses for b in blocks)
        total, squares = math.fsum(b.loss_sum for b in blocks), math.fsum(b.loss_squares for b in blocks)
        mean = total / losses if losses else None
        variance = max(0.0, (squares - total * mean) / (losses - 1)) if losses > 1 and mean is not None else None
        steps = sum(b.steps for b in blocks)
        return cls(blocks[0].first, blocks[-1].last, len(blocks), losses, mean, variance,
                   statistics.median(b.norm_median for b in blocks), sum(b.clipped for b in blocks) / steps)

    @property
    def span(self) -> str:
        return f"steps {self.first}-{self.last}"


def loss_fall(now: list[Block], before: list[Block],
              min_blocks: int) -> tuple[float, float, WindowStats, WindowStats] | None:
    """(relative fall of the mean loss from the window before to the last, its standard error, the windows), or
    None unless each window holds `min_blocks` blocks with a loss."""
    if sum(1 for b in now if b.losses) < min_blocks or sum(1 for b in before if b.losses) < min_blocks:
        return None
    a, b = WindowStats.of(now), WindowStats.of(before)
    if a.loss_variance is None or b.loss_variance is None or not b.loss_mean or b.loss_mean <= 0:
        return None
    error = math.sqrt(a.loss_variance / a.losses + b.loss_variance / b.losses)
    return (b.loss_mean - a.loss_mean) / b.loss_mean, error / b.loss_mean, a, b


class RatioBins:
    """The update-to-parameter ratios of the weight matrices measured at log steps, per span of the grid: the median
    of each span's measurements, raw and per unit of learning rate. A window's level is the median of its spans'
    medians, so a run logging every step and one logging every 50 estimate the same number."""

    def __init__(self, block_steps: int, keep: int) -> None:
        self.block_steps = block_steps
        self.closed: deque[tuple[int, dict[str, tuple[float, float]]]] = deque(maxlen=keep)  # (last step, medians)
        self.open: list[tuple[int, dict[str, float], float]] = []  # (step, ratios, lr) of the open span

    def add(self, step: int, ratios: dict[str, Any], lr: Any) -> None:
        kept = {g: float(ratios[g]) for g in MATRIX_GROUPS if finite(ratios.get(g)) and ratios[g] >= 0}
        if not kept or not (finite(lr) and lr > 0):
            return
        if self.open and self._span(self.open[-1][0]) != self._span(step):
            self._close()
        self.open.append((step, kept, float(lr)))

    def rewind(self, step: int) -> None:
        """Forget what was measured at `step` and after (a rollback: those steps are trained again)."""
        self.open = [sample for sample in self.open if sample[0] < step]
        while self.closed and self.closed[-1][0] >= step:
            self.closed.pop()

    def window(self, first: int, last: int) -> dict[str, tuple[int, float, float]]:
        """Per group: (spans measured, median ratio, median ratio per unit of learning rate) over steps first..last."""
        spans = [medians for end, medians in self.closed if first <= end <= last]
        if self.open and first <= self.open[-1][0] <= last:
            spans.append(_medians(self.open))
        out = {}
        for group in MATRIX_GROUPS:
            values = [m[group] for m in spans if group in m]
            if values:
                out[group] = (len(values), statistics.median(v[0] for v in values),
                              statistics.median(v[1] for v in values))
        return out

    def _span(self, step: int) -> int:
        return (step - 1) // self.block_steps

    def _close(self) -> None:
        self.closed.append((self.open[-1][0], _medians(self.open)))
        self.open = []


def _medians(samples: list[tuple[int, dict[str, float], float]]) -> dict[str, tuple[float, float]]:
    out = {}
    for group in MATRIX_GROUPS:
        values = [(ratios[group], ratios[group] / lr) for _, ratios, lr in samples if group in ratios]
        if values:
            out[group] = (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
    return out


def _real(value: Any) -> bool:
    """A float, infinite allowed (an overflowing norm) but not NaN, or an int64 (a stranger's file may hold an int
    too large for a float, on which math.isfinite raises)."""
    return (isinstance(value, float) and not math.isnan(value)) or (type(value) is int and abs(value) <= INT64_MAX)


def finite(value: Any) -> bool:
    """A finite float, or an int64."""
    return (isinstance(value, float) and math.isfinite(value)) or (type(value) is int and abs(value) <= INT64_MAX)
