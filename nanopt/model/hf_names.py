"""nanopt's state-dict names against Hugging Face transformers' (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, GPT2LMHeadModel): the one home of the mapping, read in both directions by `nanopt export`
(nanopt -> transformers) and `nanopt import` (transformers -> nanopt), and of which transformers model computes a
nanopt model exactly (hf_family).

- "llama": the weights keep their shapes, only the names change. Llama has one switch for the q/k/v/o biases;
  Qwen2 has biases on q/k/v and none on o_proj or the MLP; Qwen3 adds an RMSNorm per head on queries and keys
  (`self_attn.q_norm` / `k_norm`, nanopt's qk_norm). All four share Llama's tensor names.
- "gpt2": its Conv1D layers store weights as [in, out], the transpose of nn.Linear, and its c_attn fuses the q, k
  and v projections into one matrix (concatenated along nanopt's output dimension, then transposed).

A tied head (`lm_head.weight` when tie_word_embeddings) has no entry: transformers ties it on load.
"""

from __future__ import annotations

from typing import NamedTuple

from nanopt.config import ModelConfig
from nanopt.errors import ConfigError

# model_type -> the transformers class of that family
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gpt2": "GPT2LMHeadModel"}
_HINT = "train with a combination a transformers model has (see docs/export-import.md), or keep the run in nanopt"


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


def hf_family(cfg: ModelConfig) -> str:
    """The model_type of the transformers model that computes `cfg` exactly, or ConfigError naming the model.json
    option none of them has."""
    if cfg.architecture == "gpt2":
        return _gpt2_family(cfg)
    qkv, o, mlp = cfg.has_qkv_bias, bool(cfg.attention_bias), bool(cfg.mlp_bias)
    if cfg.qk_norm:
        if mlp:
            raise ConfigError("model.json: key 'qk_norm' with mlp_bias: Qwen3ForCausalLM, the transformers model "
                              "with qk-norm, has no MLP biases, so this model cannot be exported exactly", _HINT)
        if qkv != o:
            raise ConfigError(f"model.json: key 'qk_norm' with qkv_bias {str(qkv).lower()} and attention_bias "
                              f"{str(o).lower()}: Qwen3ForCausalLM has one bias switch for q, k, v and o", _HINT)
        return "qwen3"
    if qkv == o:
        return "llama"
    if qkv and not mlp:
        return "qwen2"  # biases on q/k/v only, as Qwen2
    raise ConfigError(f"model.json: key 'qkv_bias': {str(qkv).lower()} with attention_bias {str(o).lower()} and "
                      f"mlp_bias {str(mlp).lower()}: no transformers Llama-family model has this set of biases "
                      "(Llama: q, k, v, o alike; Qwen2: q, k, v only)", _HINT)


def _gpt2_family(cfg: ModelConfig) -> str:
    missing = [key for key in ("attention_bias", "mlp_bias") if not getattr(cfg, key)]
    if not cfg.has_qkv_bias and cfg.attention_bias:
        missing.append("qkv_bias")
    if missing:
        raise ConfigError(
            f"model.json: key '{missing[0]}': transformers' GPT2LMHeadModel always has biases, so a gpt2 model "
            f"trained with {' and '.join(f'{k}=false' for k in missing)} cannot be exported exactly",
            'train with the gpt2 defaults (biases on), or use architecture "llama", whose export supports both')
    if cfg.qk_norm:
        raise ConfigError("model.json: key 'qk_norm': transformers' GPT2LMHeadModel has no qk-norm, so this gpt2 "
                          "model cannot be exported exactly",
                          'use architecture "llama" (exported as Qwen3ForCausalLM), or keep the run in nanopt')
    return "gpt2"


def _kinds(bias: bool | None) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _llama(cfg: ModelConfig) -> list[HFTensor]:
    entries = [HFTensor("model.embed_tokens.weight", ("embed_tokens.weight",))]
    for i in range(cfg.num_hidden_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        entries.append(HFTensor(f"{theirs}input_layernorm.weight", (f"{ours}attn_norm.weight",)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for kind in _kinds(cfg.attention_bias if proj == "o_proj" else cfg.has_qkv_bias):
                entries.append(HFTensor(f"{theirs}self_attn.{proj}.{kind}", (f"{ours}attn.{proj}.{kind}",)))
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                entries.append(HFTensor(f"{theirs}self_attn.{norm}.weight", (f"{ours}attn.{norm}.weight",)))
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
