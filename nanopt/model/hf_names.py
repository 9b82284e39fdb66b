"""nanopt's state-dict names against Hugging Face transformers' (LlamaForCausalLM, GPT2LMHeadModel): the one home
of the mapping, read in both directions by `nanopt export` (nanopt -> transformers) and `nanopt import`
(transformers -> nanopt).

- "llama": the weights keep their shapes, only the names change.
- "gpt2": its Conv1D layers store weights as [in, out], the transpose of nn.Linear, and its c_attn fuses the q, k
  and v projections into one matrix (concatenated along nanopt's output dimension, then transposed).

A tied head (`lm_head.weight` when tie_word_embeddings) has no entry: transformers ties it on load.
"""

from __future__ import annotations

from typing import NamedTuple

from nanopt.config import ModelConfig


class HFTensor(NamedTuple):
    """One transformers tensor: its name, the nanopt tensors it holds (concatenated along nanopt's dim 0 when
    several) and whether it is stored transposed (GPT-2's Conv1D)."""

    name: str
    ours: tuple[str, ...]
    transposed: bool = False


def hf_tensors(cfg: ModelConfig) -> list[HFTensor]:
    """Every tensor of the transformers model for `cfg`, in a fixed order (each nanopt tensor in exactly one)."""
    entries = _llama(cfg) if cfg.architecture == "llama" else _gpt2(cfg)
    if not cfg.tie_word_embeddings:
        entries.append(HFTensor("lm_head.weight", ("lm_head.weight",)))
    return entries


def _kinds(bias: bool | None) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _llama(cfg: ModelConfig) -> list[HFTensor]:
    entries = [HFTensor("model.embed_tokens.weight", ("embed_tokens.weight",))]
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        entries.append(HFTensor(f"{theirs}input_layernorm.weight", (f"{ours}attn_norm.weight",)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for kind in _kinds(cfg.attention_bias):
                entries.append(HFTensor(f"{theirs}self_attn.{proj}.{kind}", (f"{ours}attn.{proj}.{kind}",)))
        entries.append(HFTensor(f"{theirs}post_attention_layernorm.weight", (f"{ours}mlp_norm.weight",)))
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for kind in _kinds(cfg.mlp_bias):
                entries.append(HFTensor(f"{theirs}mlp.{proj}.{kind}", (f"{ours}mlp.{proj}.{kind}",)))
    entries.append(HFTensor("model.norm.weight", ("norm.weight",)))
    return entries


def _gpt2(cfg: ModelConfig) -> list[HFTensor]:
    entries = [HFTensor("transformer.wte.weight", ("embed_tokens.weight",)),
               HFTensor("transformer.wpe.weight", ("embed_positions.weight",))]
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv = tuple(f"{ours}attn.{p}_proj" for p in ("q", "k", "v"))
        for kind in ("weight", "bias"):
            entries.append(HFTensor(f"{theirs}ln_1.{kind}", (f"{ours}attn_norm.{kind}",)))
            # Conv1D computes x @ W + b with W [in, out]: each nn.Linear weight transposed; biases unchanged.
            entries.append(HFTensor(f"{theirs}attn.c_attn.{kind}", tuple(f"{p}.{kind}" for p in qkv),
                                    kind == "weight"))
            entries.append(HFTensor(f"{theirs}attn.c_proj.{kind}", (f"{ours}attn.o_proj.{kind}",), kind == "weight"))
            entries.append(HFTensor(f"{theirs}ln_2.{kind}", (f"{ours}mlp_norm.{kind}",)))
            entries.append(HFTensor(f"{theirs}mlp.c_fc.{kind}", (f"{ours}mlp.up_proj.{kind}",), kind == "weight"))
            entries.append(HFTensor(f"{theirs}mlp.c_proj.{kind}", (f"{ours}mlp.down_proj.{kind}",),
                                    kind == "weight"))
    entries += [HFTensor(f"transformer.ln_f.{kind}", (f"norm.{kind}",)) for kind in ("weight", "bias")]
    return entries
