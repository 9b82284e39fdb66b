"""Pure arithmetic about a model: parameter counts, FLOPs per token, the memory model, Chinchilla, time and cost.

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

import math
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
    bias = bool(cfg.attention_bias)
    return _linear(h, h, bias) + 2 * _linear(h, kv, bias) + _linear(h, h, bias)


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
    return int(round(params * tokens_per_param))


def train_seconds(total_flops: float, num_gpus: int, peak_flops_per_gpu: float, mfu: float) -> float:
    return total_flops / (num_gpus * peak_flops_per_gpu * mfu)


def tokens_in_seconds(seconds: float, flops_per_tok: float, num_gpus: int, peak_flops_per_gpu: float,
                      mfu: float) -> int:
    return int(seconds * num_gpus * peak_flops_per_gpu * mfu / flops_per_tok)


def mfu(tokens_per_second: float, flops_per_tok: float, num_gpus: int, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilization: achieved model FLOPs / (GPUs x dense peak of the dtype)."""
    return tokens_per_second * flops_per_tok / (num_gpus * peak_flops_per_gpu)


# ------------------------------------------------------------------------------------------------- memory

# Bytes the CUDA context, cuBLAS workspaces and allocator fragmentation take before the first tensor. Measured
# figures are typically 0.5-1.5 GiB; the calibration in `nanopt find-batch` reports the error of this model.
RUNTIME_OVERHEAD_BYTES = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    gradients: int
    optimizer: int
    activations_per_sequence: int
    runtime_overhead: int

    def fixed(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.runtime_overhead

    def total(self, micro_batch_size: int) -> int:
        return self.fixed() + micro_batch_size * self.activations_per_sequence

    def max_micro_batch(self, device_bytes: int) -> int:
        return max(0, (device_bytes - self.fixed()) // max(1, self.activations_per_sequence))

    def to_dict(self, micro_batch_size: int) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations_per_sequence": self.activations_per_sequence,
                "runtime_overhead": self.runtime_overhead, "total": self.total(micro_batch_size)}


def activation_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int, compiled: bool) -> int:
    """Tensors one transformer block saves for backward, per token, with a flash-style attention kernel.

    The residual stream stays in fp32 (the master weights are fp32 and autocast keeps additions in fp32); the
    matmul inputs and outputs are in the compute dtype (`act_bytes`). torch.compile fuses the normalization and
    activation-function intermediates, so fewer tensors are saved.
    """
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    inner = cfg.intermediate_size
    residual = 2 * 4 * h  # block input and the mid-block residual, fp32
    norms = 2 * act_bytes * h  # normalized inputs to the attention and MLP projections
    # q, k, v as the attention kernel saves them, its output (o_proj's input) and its fp32 log-sum-exp per head
    attention = act_bytes * (h + 2 * kv) + act_bytes * h + 4 * cfg.num_attention_heads
    if cfg.architecture == "llama":
        mlp = act_bytes * (3 * inner)  # gate and up outputs, their product (down_proj's input)
        elementwise = act_bytes * inner  # silu(gate)
    else:
        mlp = act_bytes * (2 * inner)  # fc output, gelu output (c_proj's input)
        elementwise = 0
    if compiled:
        norms //= 2
        elementwise = 0
    return residual + norms + attention + mlp + elementwise


def loss_bytes_per_token(cfg: ModelConfig, act_bytes: int) -> int:
    """The final norm output and the fused loss's saved d(hidden); no [T, V] logits are kept."""
    return 4 * cfg.hidden_size + 2 * act_bytes * cfg.hidden_size + 8


def estimate_memory(cfg: ModelConfig, seq_len: int, *, precision: str, compiled: bool,
                    activation_checkpointing: bool, parallelism: str, world_size: int) -> MemoryEstimate:
    """Per-GPU memory of training with AdamW and fp32 master weights.

    Weights, gradients and the two Adam moments are fp32 (4 bytes each per parameter); FSDP shards all three
    across the world size, DDP replicates them. Under bf16 autocast the bf16 copies of weights live only per
    layer during the step and are counted in the runtime overhead.
    """
    params = count_params(cfg).total
    shard = world_size if parallelism == "fsdp" else 1
    act_bytes = 4 if precision == "fp32" else 2
    per_layer = activation_bytes_per_token_per_layer(cfg, act_bytes, compiled)
    if activation_checkpointing:
        # Only each block's fp32 input is kept; one block's activations are rebuilt at a time in backward.
        per_token = cfg.num_hidden_layers * 4 * cfg.hidden_size + per_layer
    else:
        per_token = cfg.num_hidden_layers * per_layer
    per_token += loss_bytes_per_token(cfg, act_bytes)
    return MemoryEstimate(
        weights=math.ceil(4 * params / shard),
        gradients=math.ceil(4 * params / shard),
        optimizer=math.ceil(8 * params / shard),
        activations_per_sequence=per_token * seq_len,
        runtime_overhead=RUNTIME_OVERHEAD_BYTES,
    )
