"""The baseline nanopt is measured against: the same architecture written as plain PyTorch in the common
nanoGPT style (eager, bf16 autocast, scaled_dot_product_attention, fused AdamW, full-logits cross-entropy).

Deliberately straightforward: this is what a careful person writes in an afternoon, not a tuned kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanopt.config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        llama = cfg.architecture == "llama"
        norm = (lambda: nn.RMSNorm(h, eps=cfg.rms_norm_eps)) if llama else (lambda: nn.LayerNorm(h))
        self.ln1, self.ln2 = norm(), norm()
        self.qkv = nn.Linear(h, h + 2 * kv, bias=bool(cfg.attention_bias))
        self.proj = nn.Linear(h, h, bias=bool(cfg.attention_bias))
        self.fc = nn.Linear(h, (2 if llama else 1) * cfg.intermediate_size, bias=bool(cfg.mlp_bias))
        self.out = nn.Linear(cfg.intermediate_size, h, bias=bool(cfg.mlp_bias))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, h = x.shape
        cfg = self.cfg
        kv = cfg.num_key_value_heads * cfg.head_dim
        q, k, v = self.qkv(self.ln1(x)).split([h, kv, kv], dim=-1)
        q = q.view(b, t, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, t, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        gqa = cfg.num_key_value_heads != cfg.num_attention_heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        hidden = self.fc(self.ln2(x))
        if cfg.architecture == "llama":
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden, approximate="tanh")
        return x + self.out(hidden)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class BaselineGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if cfg.architecture == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.ln_f = nn.RMSNorm(cfg.hidden_size) if cfg.architecture == "llama" else nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.head.weight = self.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.out.weight, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))

    def _rope(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.cfg.architecture != "llama":
            return None
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
        angles = torch.outer(torch.arange(t, device=device).float(), inv)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        rope = self._rope(t, idx.device)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
