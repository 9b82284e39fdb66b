"""model.json's `rope_scaling`: Llama 3's RoPE frequency scaling (`"rope_type": "llama3"`), which stretches the
low frequencies of RoPE by `factor` past a context of `original_max_position_embeddings` tokens, leaves the high
ones as they are, and blends the two in between (`low_freq_factor` and `high_freq_factor` bound that band). The
keys are transformers' own, so a Llama 3.1 / 3.2 config.json's `rope_scaling` reads as is. The frequencies
themselves: nanopt.model.rope."""

from __future__ import annotations

import math
from typing import Any

from nanopt.errors import ConfigError
from nanopt.parsing import show_value

ROPE_TYPES = ("llama3",)
LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")
LLAMA3_KEYS = ("rope_type", *LLAMA3_FACTORS, "original_max_position_embeddings")
EXAMPLE = ('Llama 3.2: {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
           '"original_max_position_embeddings": 8192}, or null for plain RoPE')


def check_rope_scaling(scaling: dict[str, Any] | None, architecture: str, where: str) -> None:
    """Raise ConfigError for a rope_scaling nanopt's model cannot compute. `where` names the file and the key
    ("model.json: key 'rope_scaling'")."""
    if scaling is None:
        return
    if architecture != "llama":
        raise ConfigError(f"{where}: {architecture} has learned positions, no RoPE to scale",
                          "remove the key, or use architecture \"llama\"")
    if scaling.get("rope_type") not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {show_value(scaling.get('rope_type'))} is not one nanopt computes",
                          f"use \"rope_type\": \"llama3\"; {EXAMPLE}")
    unknown = sorted(set(scaling) - set(LLAMA3_KEYS))
    missing = [key for key in LLAMA3_KEYS if key not in scaling]
    if unknown or missing:
        problem = f"unknown key '{unknown[0]}'" if unknown else f"missing '{missing[0]}'"
        raise ConfigError(f"{where}: {problem}; llama3 scaling has exactly {', '.join(LLAMA3_KEYS)}", EXAMPLE)
    for key in LLAMA3_FACTORS:
        if not _positive_number(scaling[key]):
            raise ConfigError(f"{where}: '{key}' must be a positive number, got {show_value(scaling[key])}", EXAMPLE)
    context = scaling["original_max_position_embeddings"]
    if not isinstance(context, int) or isinstance(context, bool) or context <= 0:
        raise ConfigError(f"{where}: 'original_max_position_embeddings' must be a positive integer, got "
                          f"{show_value(context)}", "the context length the model was first trained at, e.g. 8192")
    if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ConfigError(f"{where}: 'low_freq_factor' {show_value(scaling['low_freq_factor'])} must be below "
                          f"'high_freq_factor' {show_value(scaling['high_freq_factor'])}", EXAMPLE)


def _positive_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and (isinstance(value, int) or math.isfinite(value))  # an int has no inf (nor overflows here)
