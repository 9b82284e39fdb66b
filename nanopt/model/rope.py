"""RoPE's inverse frequencies for a ModelConfig: plain (theta ** -(2i / head_dim)), or with Llama 3's frequency
scaling (model.json's `rope_scaling`, checked by nanopt.config.rope_scaling).

Llama 3's rule, as Meta published it with Llama 3.1: with s = `factor`, L = `original_max_position_embeddings`, and
a frequency's wavelength w = 2 pi / f,

- w < L / high_freq_factor (many turns within the original context): f unchanged;
- w > L / low_freq_factor (less than a turn or so): f / s, interpolated as if the positions were s times denser;
- between them: (1 - t) f / s + t f, with t = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor),
  which runs from 0 at the low bound to 1 at the high one, so the three pieces join continuously.

Computed in fp32, as transformers does, so an imported Llama 3.2 encodes positions exactly as it did there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nanopt.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str | None = None) -> Tensor:
    """The head_dim / 2 inverse frequencies (fp32) of cfg's RoPE, scaled as cfg.rope_scaling says."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if cfg.rope_scaling is None:
        return inv_freq
    scaling = cfg.rope_scaling
    return llama3_scaled(inv_freq, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                         float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin of every position's angles, [max_position_embeddings, head_dim / 2] each: the model keeps
    them as buffers and reads the rows it needs (rope_at)."""
    positions = torch.arange(cfg.max_position_embeddings, device=device, dtype=torch.float32)
    angles = positions[:, None] * rope_inv_freq(cfg, device)
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_context: int) -> Tensor:
    """Llama 3's scaling of the inverse frequencies `inv_freq` (see the module docstring)."""
    wavelength = 2 * math.pi / inv_freq
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    stretched = torch.where(wavelength > original_context / low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelength < original_context / high_freq_factor, inv_freq, stretched)


def rope_at(cos_table: Tensor, sin_table: Tensor, positions: Tensor | slice) -> tuple[Tensor, Tensor]:
    """fp32 cos / sin [T, head_dim] for the positions (a slice: a run of them; a tensor [B, T]: per row, document
    masking, giving [B, 1, T, head_dim], which broadcast over the heads), read from the model's tables.

    Read from tables computed once rather than computed in each forward: compiled, Inductor folded the angles' pow,
    cos and sin into every layer's rotation and recomputed them there in the backward too (16 kernels a step for
    the 1B Llama, 3% of its step on an H100); read, the rotation is a multiply-add of rows that stay in cache.
    """
    cos, sin = cos_table[positions], sin_table[positions]
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, H, T, D] queries or keys; the math runs in fp32 and the result keeps x's dtype."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
