"""The optimizer: AdamW with weight decay on matrices and embeddings only; the LR is set per step from
nanopt.train.schedule."""

from __future__ import annotations

import torch

from nanopt.config import TrainConfig


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
