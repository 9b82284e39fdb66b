"""`"optimizer": "adamw8bit"`: AdamW with its two moments in 8 bits (torchao.optim.AdamW8bit: block-wise
dynamic quantization, a scale per 256 values; tensors under 4096 values keep fp32 moments), about 2 bytes a
parameter for the moments instead of 8. torchao is an extra: `pip install 'nanopt[lowbit]'`. It runs on the CPU
and on CUDA (its step is compiled with torch.compile on first use: a few seconds on a CPU).

A quantized moment is a tensor subclass (OptimState8bit) that neither safetensors nor torch.distributed.checkpoint
store; in a checkpoint it is its three plain tensors, `<parameter>/exp_avg_codes` (uint8, the parameter's shape),
`exp_avg_scale` (fp32, one per block) and `exp_avg_qmap` (fp32, the 256-entry code book; no dots: sharded
checkpoints join names with them), rebuilt bit for bit on load, so a
resumed run continues exactly. Whether a moment is signed follows from its name (the first moment is, the second
is not), as torchao creates them.
"""

from __future__ import annotations

from typing import Any

import torch

from nanopt.errors import ConfigError

PARTS = ("codes", "scale", "qmap")
SIGNED = {"exp_avg": True, "exp_avg_sq": False}


def build_adamw8bit(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise ConfigError("train.json: \"optimizer\": \"adamw8bit\" needs torchao, which is not installed",
                          "pip install 'nanopt[lowbit]' (torchao 0.18 or later), or use \"optimizer\": \"adamw\"") \
            from None
    return AdamW8bit(groups, lr=lr, betas=betas, eps=eps)


def _is_quantized(value: Any) -> bool:
    return torch.is_tensor(value) and all(hasattr(value, part) for part in PARTS) and type(value) is not torch.Tensor


def plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict ({"state": {name: {state name: tensor}}, "param_groups"}) with every quantized moment
    as its plain tensors and the learning rate (a tensor in torchao's groups) a number, as meta.json holds it."""
    entries = {}
    for name, entry in state["state"].items():
        plain = {}
        for key, value in entry.items():
            if _is_quantized(value):
                plain.update({f"{key}_{part}": getattr(value, part) for part in PARTS})
            else:
                plain[key] = value
        entries[name] = plain
    groups = [{**group, "lr": float(group["lr"])} for group in state["param_groups"]]
    return {**state, "state": entries, "param_groups": groups}


def quantized_state(state: dict[str, Any]) -> dict[str, Any]:
    """The reverse of plain_state: each moment stored as codes, scale and code book becomes torchao's tensor."""
    from torchao.optim.subclass_8bit import OptimState8bit

    entries = {}
    for name, entry in state["state"].items():
        stored = {f"{moment}_{part}" for moment in SIGNED for part in PARTS}
        rebuilt = {key: value for key, value in entry.items() if key not in stored}
        for moment, signed in SIGNED.items():
            if f"{moment}_codes" in entry:
                rebuilt[moment] = OptimState8bit(*(entry[f"{moment}_{part}"] for part in PARTS), signed)
        entries[name] = rebuilt
    groups = [{**group, "lr": torch.tensor(float(group["lr"]))} for group in state["param_groups"]]
    return {**state, "state": entries, "param_groups": groups}
