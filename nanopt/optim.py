"""Optimizer and learning-rate schedules.

Schedules are pure functions of (step, total steps, settings): a resumed run computes exactly the LR an
uninterrupted one would, with no scheduler state to save or lose.
"""

from __future__ import annotations

import math

import torch

from nanopt.config import TrainConfig


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
    decay_start = max(warmup, last - int(round(cfg.decay_fraction * total_steps)))
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, last - decay_start))
    return peak + (floor - peak) * progress


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings (dim >= 2); never biases or normalization gains (dim < 2)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; the fused CUDA kernel on GPUs (one launch for all parameters), foreach on the CPU."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, fused=fused,
                             foreach=None if fused else True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
