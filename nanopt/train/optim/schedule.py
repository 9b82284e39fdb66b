"""Learning-rate schedules: pure functions of (step, total steps, settings).

A resumed run computes exactly the LR an uninterrupted one would, with no scheduler state to save or lose.
"""

from __future__ import annotations

import math

from nanopt.config import TrainConfig
from nanopt.config.mixture import wsd_decay_start


def lr_at(step: float, total_steps: float, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`.

    warmup: linear from peak/warmup_steps up to the peak over `warmup_steps` steps (never 0, so step 0 learns);
    cosine: then half a cosine from the peak down to min_lr_ratio x peak at the last step;
    wsd: then constant (stable) until the last `decay_fraction` of the steps, which decay linearly to the minimum;
    constant: the peak after warmup.
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:  # min: a fractional step (batch warmup, scheduled_lr) may end past the warmup
        return peak * min(1.0, (step + 1) / warmup)
    if cfg.lr_schedule == "constant":
        return peak
    last = max(total_steps - 1, 1)
    if cfg.lr_schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, last - warmup))
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = wsd_decay_start(total_steps, cfg.warmup_steps, cfg.decay_fraction)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, last - decay_start))
    return peak + (floor - peak) * progress


def scheduled_lr(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """lr_at for optimizer step `step`; under batch warmup (train.json batch_warmup_tokens) the schedule follows
    tokens instead, counted in full batches (global_batch_tokens): a step ending after T tokens is step T / full - 1
    of total tokens / full, so warmup_steps, the cosine and WSD's decay span the same tokens as without the ramp, a
    short step of the ramp moves the schedule on by its tokens only, and the last step still ends at the floor."""
    if cfg.batch_ramp is None:
        return lr_at(step, total_steps, cfg)
    full = cfg.global_batch_tokens
    return lr_at(cfg.tokens_before(step + 1) / full - 1, cfg.tokens_before(total_steps) / full, cfg)


def recovery_lr_multiplier(step: int, ramp_start: int, factor: float, ramp_steps: int) -> float:
    """The multiplier on lr_at after an automatic rollback (nanopt.train.guard.recovery) to step `ramp_start`: `factor`
    there, rising linearly to 1 over `ramp_steps` steps; 1 when there was no rollback (factor 1)."""
    if factor >= 1 or step >= ramp_start + ramp_steps:
        return 1.0
    return factor + (1.0 - factor) * max(0, step - ramp_start) / ramp_steps
