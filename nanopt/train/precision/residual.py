"""train.json "bf16_residual": the residual stream between blocks kept in bf16 instead of fp32.

Under bf16 autocast each block computes in bf16 but its output is added into an fp32 stream (the embeddings'
dtype), so the stream, its gradient and what backward saves of it move 4 bytes per element. In bf16 they move 2:
less memory and traffic, and each residual addition rounded to bf16's 8 bits of mantissa. The norms still compute
in fp32 (RMSNorm upcasts; LayerNorm runs in fp32 under autocast). Because it changes the numerics it is opt-in,
and the GPU window's bf16-against-fp32 tolerance decides whether it is worth offering beyond that.

Parameters, checkpoints and exports are the same either way; evaluation inside training runs the stream as
training does, `nanopt eval` and export build the plain model.
"""

from __future__ import annotations

import torch

from nanopt.config import RunConfig
from nanopt.errors import ConfigError


def check_bf16_residual(run: RunConfig, precision: str) -> None:
    """ConfigError, one line, unless the run computes in bf16; nothing when the setting is off."""
    if run.train.bf16_residual and precision != "bf16":
        raise ConfigError(f"{run.run_dir / 'train.json'}: key 'bf16_residual': true needs \"precision\": \"bf16\" "
                          f"(the blocks' bf16 outputs are what the stream keeps); this run computes in {precision}",
                          "set \"precision\": \"bf16\" (or \"auto\" on a GPU with bf16), or \"bf16_residual\": false")


def residual_dtype(on: bool) -> torch.dtype | None:
    """The model's residual_dtype for train.json's setting (nanopt.model.transformer.Transformer)."""
    return torch.bfloat16 if on else None
