"""The memory model: per-GPU peak memory of training a model, predicted without torch.

It predicts the peak as nanopt measures it everywhere (nanopt.runtime.MemoryProbe): on CUDA the caching
allocator's peak reserved bytes plus the CUDA context. `nanopt estimate` and `nanopt find-batch` (whose trials
report this model's error) call the same `estimate_memory`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanopt.config import ModelConfig
from nanopt.model.flops import count_params

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
                    activation_checkpointing: bool, parallelism: str, world_size: int,
                    optimizer: str = "adamw") -> MemoryEstimate:
    """Per-GPU memory of training with AdamW (or Muon, train.json's `optimizer`) and fp32 master weights.

    Weights, gradients and the two Adam moments are fp32 (4 bytes each per parameter); Muon keeps one fp32
    momentum buffer for the hidden matrices it updates instead. FSDP shards all three across the world size, DDP
    replicates them. Under bf16 autocast the bf16 copies of weights live only per layer during the step and are
    counted in the runtime overhead.
    """
    shard = world_size if parallelism == "fsdp" else 1
    act_bytes = 4 if precision == "fp32" else 2
    per_layer = activation_bytes_per_token_per_layer(cfg, act_bytes, compiled)
    if activation_checkpointing:
        # Only each block's fp32 input is kept; one block's activations are rebuilt at a time in backward.
        per_token = cfg.num_hidden_layers * 4 * cfg.hidden_size + per_layer
    else:
        per_token = cfg.num_hidden_layers * per_layer
    per_token += loss_bytes_per_token(cfg, act_bytes)
    muon_params = hidden_matrix_params(cfg) if optimizer == "muon" else 0
    return states_only(count_params(cfg).total, shard, activations_per_sequence=per_token * seq_len,
                       muon_params=muon_params)


def hidden_matrix_params(cfg: ModelConfig) -> int:
    """Parameters of the 2-D projection weights inside the blocks (no biases): what Muon updates
    (nanopt.train.optim.is_hidden_matrix); embeddings, head, norms and biases stay with AdamW."""
    h, kv, inner = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    mlp_matrices = 3 if cfg.architecture == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: up, down
    return cfg.num_hidden_layers * (2 * h * h + 2 * h * kv + mlp_matrices * h * inner)


def states_only(params: int, shard: int = 1, activations_per_sequence: int = 0, muon_params: int = 0) -> MemoryEstimate:
    """fp32 weights and gradients (4 bytes each per parameter) and AdamW's two moments (8), or Muon's one momentum
    buffer (4) for the `muon_params` it updates, sharded `shard` ways, plus the runtime overhead: all that can be
    said from a bare parameter count."""
    optimizer = 8 * (params - muon_params) + 4 * muon_params
    return MemoryEstimate(weights=math.ceil(4 * params / shard), gradients=math.ceil(4 * params / shard),
                          optimizer=math.ceil(optimizer / shard), activations_per_sequence=activations_per_sequence,
                          runtime_overhead=RUNTIME_OVERHEAD_BYTES)
