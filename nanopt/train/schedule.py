"""Learning-rate schedules: pure functions of (step, total steps, settings).

A resumed run computes exactly the LR an uninterrupted one would, with no scheduler state to save or lose.
"""

from __future__ import annotations

import math

from nanopt.config import TrainConfig
from nanopt.config.mixture import wsd_decay_start


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`.

    warmup: linear from peak/warmup_steps up to the peak over `warmup_steps` steps (never 0, so step 0 learns);
    cosine: then half a cosine from the peak down to min_lr_ratio x peak at the last step;
    wsd: then constant (stable) until the last `decay_fraction` of the steps, which decay linearly to the minimum;
    constant: the peak after warmup.
    """
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.warmup_steps, total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
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


def recovery_lr_multiplier(step: int, ramp_start: int, factor: float, ramp_steps: int) -> float:
    """The multiplier on lr_at after an automatic rollback (nanopt.train.recovery) to step `ramp_start`: `factor`
    there, rising linearly to 1 over `ramp_steps` steps; 1 when there was no rollback (factor 1)."""
    if factor >= 1 or step >= ramp_start + ramp_steps:
        return 1.0
    return factor + (1.0 - factor) * max(0, step - ramp_start) / ramp_steps
