"""model.json's typed config: the architecture of a decoder-only transformer, every key's type and range, and the
defaults derived from the others. Reading it from a file or a checkpoint: nanopt.config.load."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from nanopt.config.checks import check_positive, divisors
from nanopt.config.rope_scaling import check_rope_scaling
from nanopt.errors import ConfigError

Architecture = Literal["llama", "gpt2"]
InitRule = Literal["normal", "fan_in"]

# No model dimension (vocabulary, widths, layers, heads, positions) above 2**24 = 16,777,216: a hundred times the
# largest of each in today's models, and small enough that every size derived from them stays exact. A value past it
# is a typo, whose model would ask for petabytes at the first allocation.
MAX_MODEL_DIMENSION = 2**24


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer. `llama`: RoPE, RMSNorm, SwiGLU, GQA. `gpt2`: learned
    positions, LayerNorm, GELU MLP, biases."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    intermediate_size: int | None = None  # default: 4 x hidden (gpt2); the Llama 8/3 rule rounded to 256
    num_key_value_heads: int | None = None  # default: num_attention_heads (no GQA)
    rope_theta: float = 10000.0
    # Llama 3's frequency scaling (nanopt.config.rope_scaling), or None for plain RoPE. A JSON object, so it is left
    # out of the hash (a ModelConfig keys caches): configs that differ only here hash alike and still compare unequal.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    attention_bias: bool | None = None  # default: True for gpt2, False for llama
    mlp_bias: bool | None = None  # default: True for gpt2, False for llama
    dropout: float = 0.0
    initializer_range: float = 0.02
    # Recipe options, off by default (checkpoints from before them load unchanged; keys kept as given, so a
    # checkpoint that does not name one means its default).
    qkv_bias: bool | None = None  # biases on the q, k, v projections; default: as attention_bias (which has o_proj)
    qk_norm: bool = False  # RMSNorm (rms_norm_eps) on each head's queries and keys, before RoPE (Qwen3)
    init: InitRule = "normal"  # normal: std initializer_range; fan_in: std 1/sqrt(fan_in) for the projections
    document_masking: bool = False  # attention stops at EOS: a token sees its own document only, positions restart
    eos_token_id: int | None = None  # the EOS that ends a document, with document_masking (the dataset's)

    def __post_init__(self) -> None:
        is_gpt2 = self.architecture == "gpt2"
        if self.intermediate_size is None:
            default = 4 * self.hidden_size if is_gpt2 else _llama_intermediate(self.hidden_size)
            object.__setattr__(self, "intermediate_size", default)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        for name in ("attention_bias", "mlp_bias"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, is_gpt2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def has_qkv_bias(self) -> bool:
        return bool(self.attention_bias if self.qkv_bias is None else self.qkv_bias)

    def validate(self, source: str = "model.json") -> None:
        dimensions = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                      "max_position_embeddings", "intermediate_size", "num_key_value_heads")
        check_positive(self, source, dimensions)
        for name in dimensions:
            if getattr(self, name) > MAX_MODEL_DIMENSION:
                raise ConfigError(f"{source}: key '{name}': {getattr(self, name)} is larger than "
                                  f"{MAX_MODEL_DIMENSION:,}, the largest model dimension nanopt accepts",
                                  "check for a typo; see runs/*/model.json for typical values")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{source}: key 'num_attention_heads': {self.num_attention_heads} does not divide "
                f"hidden_size {self.hidden_size}",
                f"use a head count from {divisors(self.hidden_size, 8, 128)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{source}: key 'num_key_value_heads': {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}",
                f"use one of {divisors(self.num_attention_heads, 1, self.num_attention_heads)}")
        if self.architecture == "llama" and self.head_dim % 2:
            raise ConfigError(f"{source}: key 'hidden_size': head size {self.head_dim} is odd, RoPE needs it even",
                              "choose hidden_size / num_attention_heads even")
        if self.architecture == "gpt2" and self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(f"{source}: key 'num_key_value_heads': gpt2 has no grouped-query attention",
                              "remove the key or use architecture \"llama\"")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{source}: key 'dropout': {self.dropout} is outside [0, 1)", "use e.g. 0.0 or 0.1")
        for name in ("rope_theta", "rms_norm_eps", "layer_norm_eps", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{source}: key '{name}': must be positive, got {getattr(self, name)}",
                                  "see runs/*/model.json for typical values")
        check_rope_scaling(self.rope_scaling, self.architecture, f"{source}: key 'rope_scaling'")
        self._check_document_masking(source)

    def _check_document_masking(self, source: str) -> None:
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"{source}: key 'eos_token_id': {self.eos_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size})", "use the dataset's eos_id (its meta.json)")
        if self.document_masking and self.eos_token_id is None:
            raise ConfigError(f"{source}: key 'document_masking': needs 'eos_token_id', the token that ends a "
                              "document", "add \"eos_token_id\": the dataset's eos_id (its meta.json)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _llama_intermediate(hidden: int) -> int:
    return 256 * math.ceil(int(8 * hidden / 3) / 256)
