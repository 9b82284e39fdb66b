"""Pure arithmetic about a model: parameter counts, FLOPs per token, MFU, Chinchilla, time and cost.

Nothing here touches torch, so `nanopt estimate` answers in milliseconds and these formulas can be tested
against the built model.

Conventions:
- Parameters count tied weights once, exactly as `sum(p.numel() for p in model.parameters())`.
- Non-embedding parameters exclude the token and position embeddings and an untied output head (Kaplan et al.).
- Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6 x (non-embedding params + output head)
  + 12 x layers x hidden x seq_len. The head's matmul runs whether or not its weights are tied; the attention
  term counts QK^T and AV for a full (non-causal) window, as the PaLM MFU convention does.
- `6N` is the simpler Kaplan / Chinchilla estimate with N = all parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanopt.config import ModelConfig

CHINCHILLA_TOKENS_PER_PARAM = 20.0


@dataclass(frozen=True)
class ParamCount:
    total: int
    token_embedding: int
    position_embedding: int
    output_head: int  # 0 when tied to the token embedding
    per_layer: int
    final_norm: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.token_embedding - self.position_embedding - self.output_head


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _norm_params(cfg: ModelConfig) -> int:
    # RMSNorm has a weight only; LayerNorm a weight and a bias.
    return cfg.hidden_size if cfg.architecture == "llama" else 2 * cfg.hidden_size


def _attention_params(cfg: ModelConfig) -> int:
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    qkv_bias = cfg.has_qkv_bias
    qk_norm = 2 * cfg.head_dim if cfg.qk_norm else 0  # one RMSNorm weight per head width, for queries and keys
    return _linear(h, h, qkv_bias) + 2 * _linear(h, kv, qkv_bias) + _linear(h, h, bool(cfg.attention_bias)) + qk_norm


def _mlp_params(cfg: ModelConfig) -> int:
    h, inner, bias = cfg.hidden_size, cfg.intermediate_size, bool(cfg.mlp_bias)
    projections_in = 2 if cfg.architecture == "llama" else 1  # SwiGLU has gate and up; GELU MLP has one
    return projections_in * _linear(h, inner, bias) + _linear(inner, h, bias)


def count_params(cfg: ModelConfig) -> ParamCount:
    """Closed-form parameter count of `nanopt.model.Transformer(cfg)`."""
    token_embedding = cfg.vocab_size * cfg.hidden_size
    position_embedding = cfg.max_position_embeddings * cfg.hidden_size if cfg.architecture == "gpt2" else 0
    output_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    per_layer = _attention_params(cfg) + _mlp_params(cfg) + 2 * _norm_params(cfg)
    final_norm = _norm_params(cfg)
    total = token_embedding + position_embedding + output_head + cfg.num_hidden_layers * per_layer + final_norm
    return ParamCount(total, token_embedding, position_embedding, output_head, per_layer, final_norm)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), PaLM convention, attention included."""
    params = count_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    attention = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len
    return 6 * (params.non_embedding + head) + attention


def flops_per_token_6n(cfg: ModelConfig) -> int:
    return 6 * count_params(cfg).total


def chinchilla_tokens(params: int, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> int:
    # At least one token: a budget is compared as a multiple of it (a 1-parameter model at 0.1 tokens each).
    return max(1, int(round(params * tokens_per_param)))


def train_seconds(total_flops: float, num_gpus: int, peak_flops_per_gpu: float, mfu: float) -> float:
    return total_flops / (num_gpus * peak_flops_per_gpu * mfu)


def tokens_in_seconds(seconds: float, flops_per_tok: float, num_gpus: int, peak_flops_per_gpu: float,
                      mfu: float) -> int:
    return int(seconds * num_gpus * peak_flops_per_gpu * mfu / flops_per_tok)


# What to show instead of an MFU above 100%: no run beats the hardware's dense peak, so such a number means the
# peak is wrong for this device (a card taken for another in nanopt.hardware's table, or a CPU whose /proc/cpuinfo
# understates its vector units), never a result.
IMPLAUSIBLE_MFU = "implausible (the device's peak FLOP/s is too low: a GPU taken for another, or a CPU's vector units)"


def mfu(tokens_per_second: float, flops_per_tok: float, num_gpus: int,
        peak_flops_per_gpu: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOPs / (GPUs x dense peak of the dtype), between 0 and 1.

    None without a peak, and None for a value above 1.0, which is impossible: `mfu_note` tells the two apart, so
    a caller shows IMPLAUSIBLE_MFU instead of a number. The one place MFU is computed: train's log lines and
    summary, profile, find-batch, estimate and the benches.
    """
    if not peak_flops_per_gpu:
        return None
    utilization = tokens_per_second * flops_per_tok / (num_gpus * peak_flops_per_gpu)
    return utilization if utilization <= 1.0 else None


def mfu_note(mfu_value: float | None, peak_flops_per_gpu: float | None) -> str | None:
    """IMPLAUSIBLE_MFU when `mfu` had a peak and still gave no value (it was above 100%); else None."""
    return IMPLAUSIBLE_MFU if mfu_value is None and peak_flops_per_gpu else None


def fp8_peak_label(peak_source: str, fp8: str) -> str:
    """With train.json's fp8 on, MFU is still the model's FLOPs against the dense BF16 peak (not the FP8 peak, twice
    as high), in training and in the estimate, whose time therefore assumes no FP8 speedup (a preflight of the FP8
    run measures it): the label says so, so the figure compares with a bf16 run's."""
    return peak_source if fp8 == "off" else f"{peak_source}; fp8 \"{fp8}\": MFU against the BF16 peak"
