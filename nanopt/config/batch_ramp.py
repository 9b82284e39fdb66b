"""Batch-size warmup: the global batch grows from a small one to global_batch_tokens over the first tokens of a run.

train.json's `batch_warmup_start_tokens` S (the first step's global batch) and `batch_warmup_tokens` N (the tokens
the ramp lasts) give J = global_batch_tokens / S levels. While the tokens trained before a step are T < N, the step's
batch is S x (1 + floor((J - 1) x T / N)): the linear ramp from S to the target, rounded down to whole multiples of
S; from N on it is the target. Every level is a whole multiple of S, and S is a whole number of micro-batches on
every rank (checked where the world size is known), so only gradient accumulation changes along the ramp: the
micro-batch, and so the compiled shapes and the peak memory, stay those of the full batch.

Everything here is a pure function of the step and these three numbers, never of the world size: the tokens of step
k, and the tokens before it (a prefix sum over the levels), which the loader divides by seq_len for the first global
sample of step k. So a run resumes exactly at any step, on any number of ranks, across a level boundary or not.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

from nanopt.errors import ConfigError


@dataclass(frozen=True)
class Level:
    """Steps [first_step, next level's) each train `batch_tokens`; `tokens_before` were trained before first_step."""

    first_step: int
    tokens_before: int
    batch_tokens: int


class BatchRamp:
    """The batch of every step of a run with batch-size warmup (see the module docstring)."""

    def __init__(self, start_tokens: int, target_tokens: int, ramp_tokens: int) -> None:
        if not 0 < start_tokens < target_tokens or target_tokens % start_tokens or ramp_tokens < 1:
            raise ValueError(f"start {start_tokens} must divide target {target_tokens} and be smaller; ramp "
                             f"{ramp_tokens} must be positive")
        self.start_tokens, self.target_tokens, self.ramp_tokens = start_tokens, target_tokens, ramp_tokens
        self.levels = _levels(start_tokens, target_tokens, ramp_tokens)
        self._firsts = [level.first_step for level in self.levels]

    @property
    def ramp_steps(self) -> int:
        """Steps before the first full-size one."""
        return self.levels[-1].first_step

    def _level(self, step: int) -> Level:
        return self.levels[bisect.bisect_right(self._firsts, step) - 1]

    def tokens_in(self, step: int) -> int:
        """The global batch of step `step` (0-based), in tokens."""
        return self._level(step).batch_tokens

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the steps before `step` (the prefix sum of tokens_in)."""
        level = self._level(step)
        return level.tokens_before + (step - level.first_step) * level.batch_tokens

    def steps_for(self, tokens: int) -> int:
        """The fewest steps that train at least `tokens` tokens."""
        for index, level in enumerate(self.levels):
            last = index == len(self.levels) - 1
            if last or tokens <= self.levels[index + 1].tokens_before:
                left = max(0, tokens - level.tokens_before)
                return level.first_step + -(-left // level.batch_tokens)
        raise AssertionError("the last level has no end")  # pragma: no cover


@lru_cache(maxsize=16)
def ramp_of(start_tokens: int, target_tokens: int, ramp_tokens: int) -> BatchRamp:
    """One BatchRamp per setting: config properties ask for it often, and its table is built once."""
    return BatchRamp(start_tokens, target_tokens, ramp_tokens)


def _levels(start: int, target: int, ramp: int) -> tuple[Level, ...]:
    """The levels with at least one step: level j (batch j x start, j < J) runs while tokens_before < ceil(j x N /
    (J - 1)); a level whose span the previous one already passed has no step."""
    count = target // start
    levels: list[Level] = []
    step = before = 0
    for j in range(1, count):
        boundary = -(-j * ramp // (count - 1))
        steps = max(0, -(-(boundary - before) // (j * start)))
        if steps:
            levels.append(Level(step, before, j * start))
            step, before = step + steps, before + steps * j * start
    levels.append(Level(step, before, target))
    return tuple(levels)


def check_batch_warmup(start: int | None, ramp: int | None, target: int, unit: int, mixture: bool, source: str,
                       unit_is: str = "micro_batch_size x seq_len") -> None:
    """ConfigError unless the batch-warmup keys are both absent, or both given with a start that is a whole number
    of `unit`s (one micro-batch on every rank: `unit_is` says what it is made of) dividing the target, on one
    dataset. A level is a multiple of the start, so then every step is whole micro-batches on every rank."""
    if start is None and ramp is None:
        return
    if start is None or ramp is None:
        raise ConfigError(f"{source}: batch warmup needs both 'batch_warmup_tokens' and 'batch_warmup_start_tokens'",
                          "e.g. \"batch_warmup_tokens\": \"500M\" and \"batch_warmup_start_tokens\": an eighth of "
                          "global_batch_tokens")
    if ramp <= 0:
        raise ConfigError(f"{source}: key 'batch_warmup_tokens': must be positive, got {ramp}", "e.g. \"500M\"")
    if not 0 < start < target or target % start or start % unit:
        example = max(unit, target // 8 // unit * unit)
        raise ConfigError(f"{source}: key 'batch_warmup_start_tokens': {start} is not a whole number of micro-batches "
                          f"per rank ({unit_is} = {unit} tokens) that divides global_batch_tokens {target} and is "
                          f"smaller", f"use a multiple of {unit} that divides {target}, e.g. {example}")
    if mixture:
        raise ConfigError(f"{source}: key 'batch_warmup_tokens': batch warmup does not work with a data mixture (its "
                          "sources are interleaved by a fixed batch)", "remove the batch_warmup keys, or train on "
                          "one dataset")
