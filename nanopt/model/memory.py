"""The memory model: per-GPU peak memory of training a model, predicted without torch.

It predicts the peak as nanopt measures it everywhere (nanopt.devices.MemoryProbe): on CUDA the caching
allocator's peak reserved bytes plus the CUDA context. `nanopt estimate` and `nanopt find-batch` (whose trials
report this model's error) call the same `estimate_memory`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nanopt.config import ModelConfig
from nanopt.model.flops import count_params
from nanopt.model.loss_chunks import LOSS_CHUNKS

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
    # The loss's fp32 head gradient, formed in forward and held until backward, and its bf16 copy there (per GPU,
    # never sharded: the loss runs on the gathered head).
    loss_buffers: int = 0
    # "zero2": every block's gathered weights, kept from forward to backward.
    gathered: int = 0
    # "fsdp_offload": the sharded weights, gradients and optimizer state, in host memory instead (per rank).
    host: int = 0

    def fixed(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.runtime_overhead + self.loss_buffers
                + self.gathered)

    def total(self, micro_batch_size: int) -> int:
        return self.fixed() + micro_batch_size * self.activations_per_sequence

    def max_micro_batch(self, device_bytes: int) -> int:
        return max(0, (device_bytes - self.fixed()) // max(1, self.activations_per_sequence))

    def to_dict(self, micro_batch_size: int) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations_per_sequence": self.activations_per_sequence,
                "runtime_overhead": self.runtime_overhead, "loss_buffers": self.loss_buffers,
                "gathered": self.gathered, "host": self.host, "total": self.total(micro_batch_size)}


# Which SDPA kernel CUDA runs for nanopt's training attention (causal, no mask, enable_gqa for grouped queries).
# Flash takes fp16/bf16 with a head size that is a multiple of 8 up to 256; the memory-efficient kernel takes fp32
# too but not enable_gqa; anything else falls back to the math kernel, which materializes the [B, H, T, T] scores.
FLASH_MAX_HEAD_DIM = 256


def attention_kernel(cfg: ModelConfig, precision: str) -> str:
    """"flash", "efficient" or "math": the SDPA kernel a CUDA training step gets for this shape and precision.
    Document masking passes a mask, which flash does not take, and expands grouped K/V heads for the
    memory-efficient kernel (nanopt.model.transformer.Attention._attend_documents)."""
    if cfg.document_masking:
        return "efficient"
    head_ok = cfg.head_dim % 8 == 0 and cfg.head_dim <= FLASH_MAX_HEAD_DIM
    if precision in ("bf16", "fp16") and head_ok:
        return "flash"
    grouped = cfg.num_key_value_heads != cfg.num_attention_heads
    return "math" if grouped else "efficient"


def attention_fallback_warning(cfg: ModelConfig, precision: str) -> str | None:
    """One line naming the math-kernel fallback and its fix, or None when training gets a memory-efficient kernel."""
    if attention_kernel(cfg, precision) != "math":
        return None
    grouped = f"grouped-query attention ({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} KV heads)"
    if precision not in ("bf16", "fp16"):
        return (f"{precision} with {grouped} runs PyTorch's slow math attention kernel, which stores "
                f"[batch, heads, seq, seq] scores; set \"precision\": \"bf16\" in train.json for the flash kernel")
    return (f"head size {cfg.head_dim} with {grouped} runs PyTorch's slow math attention kernel, which stores "
            f"[batch, heads, seq, seq] scores (flash takes multiples of 8 up to {FLASH_MAX_HEAD_DIM}); change "
            "hidden_size or num_attention_heads in model.json (whatever \"precision\" is)")


def activation_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int, compiled: bool) -> int:
    """Tensors one transformer block saves for backward, per token, with a flash-style attention kernel.

    The residual stream stays in fp32 (the master weights are fp32 and autocast keeps additions in fp32); the
    matmul inputs and outputs are in the compute dtype (`act_bytes`). torch.compile fuses the normalization and
    activation-function intermediates, so fewer tensors are saved.
    """
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    inner = cfg.intermediate_size
    residual = 2 * 4 * h  # block input and the mid-block residual, fp32
    # Per RMSNorm, the normalized values (kept for the gain's gradient) and the scaled output (the projections'
    # input); LayerNorm's kernel keeps only its output (and a mean and rstd per token): counted by saved-tensor hooks
    # on the CPU (tests/test_memory_ladder.py).
    norms = (4 if cfg.architecture == "llama" else 2) * act_bytes * h
    # q, k, v as the attention kernel saves them, its output (o_proj's input) and its fp32 log-sum-exp per head
    attention = act_bytes * (h + 2 * kv) + act_bytes * h + 4 * cfg.num_attention_heads
    if cfg.architecture == "llama":
        mlp = act_bytes * (3 * inner)  # gate and up outputs, their product (down_proj's input)
        elementwise = act_bytes * inner  # silu(gate)
    else:
        mlp = act_bytes * (2 * inner)  # fc output, gelu output (c_proj's input)
        elementwise = 0
    # qk_norm: the per-head RMSNorm's input in fp32, its output in the compute dtype and its fp32 1/rms per head,
    # for queries and keys
    heads = cfg.num_attention_heads + cfg.num_key_value_heads
    qk_norm = (4 + act_bytes) * (h + kv) + 4 * heads if cfg.qk_norm else 0
    if compiled:
        norms //= 2
        elementwise = 0
        qk_norm = act_bytes * (h + kv) if cfg.qk_norm else 0  # fused: only the projection's output is kept
    return residual + norms + attention + mlp + elementwise + qk_norm


def expanded_kv_bytes(cfg: ModelConfig, act_bytes: int) -> int:
    """Per token and layer, what document masking adds on CUDA: grouped K/V heads expanded to every query head
    for the memory-efficient kernel. (The [seq, seq] mask itself is one per sequence: document_mask_bytes.)"""
    if not cfg.document_masking:
        return 0
    return 2 * act_bytes * (cfg.num_attention_heads - cfg.num_key_value_heads) * cfg.head_dim


def document_mask_bytes(cfg: ModelConfig, act_bytes: int, seq_len: int) -> int:
    """Per sequence: the additive [seq, seq] mask in the compute dtype, built once per forward and kept for
    backward (every layer shares it), and llama's fp32 RoPE cos / sin tables, per row once positions restart
    with each document; 0 without document masking."""
    if not cfg.document_masking:
        return 0
    rope_tables = 2 * 4 * seq_len * cfg.head_dim if cfg.architecture == "llama" else 0
    return act_bytes * seq_len * seq_len + rope_tables


def math_attention_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int, seq_len: int) -> int:
    """What the math kernel saves beyond a flash-style kernel: the softmaxed scores (one row of seq_len per head)
    and the K/V heads expanded to every query head, less the log-sum-exp it does not keep."""
    expanded_kv = 2 * act_bytes * (cfg.num_attention_heads - cfg.num_key_value_heads) * cfg.head_dim
    return act_bytes * cfg.num_attention_heads * seq_len + expanded_kv - 4 * cfg.num_attention_heads


def loss_bytes_per_token(cfg: ModelConfig, act_bytes: int, compiled: bool) -> int:
    """The final norm output, the loss's saved d(hidden), and its per-chunk transients spread over the tokens: one
    chunk's fp32 logits (reused in place for the probabilities; eager logsumexp adds a temporary of the same size)
    and the chunk's logits gradient in the compute dtype. No [T, V] logits are kept."""
    saved = 4 * cfg.hidden_size + 2 * act_bytes * cfg.hidden_size + 8
    chunk = cfg.vocab_size * (4 + (0 if compiled else 4) + act_bytes)
    return saved + -(-chunk // LOSS_CHUNKS)


def loss_buffer_bytes(cfg: ModelConfig, act_bytes: int) -> int:
    """The fp32 head gradient the loss accumulates in forward and keeps until backward, where it is scaled in place
    and, under bf16 autocast, cast to bf16 for autograd (which casts that to the fp32 .grad, counted as gradients)
    while every activation is still alive."""
    head = cfg.vocab_size * cfg.hidden_size
    return 4 * head + (act_bytes * head if act_bytes < 4 else 0)


def estimate_memory(cfg: ModelConfig, seq_len: int, *, precision: str, compiled: bool,
                    activation_checkpointing: bool | int | str, parallelism: str, world_size: int,
                    optimizer: str = "adamw", cuda: bool = True) -> MemoryEstimate:
    """Per-GPU memory of training with AdamW (or Muon, train.json's `optimizer`) and fp32 master weights, at one
    rung of the ladder: train.json's `parallelism` (SHARDED_STATES) and `activation_checkpointing` (any
    granularity: checkpointed_blocks).

    On CUDA (`cuda`) attention costs what the SDPA kernel the shape and precision get holds (attention_kernel):
    the math fallback adds its [H, T, T] scores per layer and, at the peak of one layer's backward, two more
    score-sized tensors. On the CPU, SDPA's flash kernel takes every precision and grouping.

    Weights, gradients and the two Adam moments are fp32 (4 bytes each per parameter); Muon keeps one fp32
    momentum buffer for the hidden matrices it updates instead. Under bf16 autocast the bf16 copies of weights
    live only per layer during the step and are counted in the runtime overhead (except zero2's, kept for every
    block: `gathered`).
    """
    parallelism = parallelism if world_size > 1 else "ddp"  # one process shards nothing (nanopt.train.parallel)
    act_bytes = 4 if precision == "fp32" else 2
    math_attention = cuda and attention_kernel(cfg, precision) == "math"
    extra = math_attention_bytes_per_token_per_layer(cfg, act_bytes, seq_len) if math_attention else 0
    if cuda:
        extra += expanded_kv_bytes(cfg, act_bytes)
    kept, recomputed = block_activation_bytes_per_token(cfg, act_bytes, compiled, activation_checkpointing, extra)
    per_token = kept + recomputed + loss_bytes_per_token(cfg, act_bytes, compiled)
    per_sequence = per_token * seq_len + document_mask_bytes(cfg, act_bytes, seq_len)
    if math_attention:  # the scores' gradient and the probabilities' gradient in one layer's backward
        per_sequence += 2 * act_bytes * cfg.num_attention_heads * seq_len * seq_len
    muon_params = hidden_matrix_params(cfg) if optimizer == "muon" else 0
    states = states_only(count_params(cfg).total, world_size, activations_per_sequence=per_sequence,
                         muon_params=muon_params, parallelism=parallelism,
                         adam_bytes=ADAM_8BIT_BYTES if optimizer == "adamw8bit" else 8)
    gathered = act_bytes * block_params(cfg) if parallelism == "zero2" else 0
    return dataclasses.replace(states, loss_buffers=loss_buffer_bytes(cfg, act_bytes), gathered=gathered)


SELECTIVE = "selective"


def checkpointed_blocks(setting: bool | int | str, num_blocks: int) -> list[int]:
    """The indices of the blocks whose activations are recomputed in backward (train.json's
    `activation_checkpointing`: false, true, "selective", or k for every k-th block: k, 2k, ...)."""
    if setting is False:
        return []
    every = 1 if setting is True or setting == SELECTIVE else int(setting)
    return [index for index in range(num_blocks) if (index + 1) % every == 0]


def block_activation_bytes_per_token(cfg: ModelConfig, act_bytes: int, compiled: bool,
                                     checkpointing: bool | int | str, extra_per_layer: int = 0) -> tuple[int, int]:
    """(bytes the blocks keep for backward at the end of forward, bytes of the one block rebuilt at a time in
    backward), per token. A checkpointed block keeps only its fp32 input; a selectively checkpointed one its input
    and its matmul and attention outputs."""
    per_layer = activation_bytes_per_token_per_layer(cfg, act_bytes, compiled) + extra_per_layer
    layers = cfg.num_hidden_layers
    recomputed = len(checkpointed_blocks(checkpointing, layers))
    block_input = 4 * cfg.hidden_size
    if checkpointing == SELECTIVE:
        return layers * (block_input + selective_bytes_per_token_per_layer(cfg, act_bytes)), per_layer
    return (layers - recomputed) * per_layer + recomputed * block_input, per_layer if recomputed else 0


def selective_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int) -> int:
    """What selective checkpointing keeps of a block (nanopt.train.recompute): every projection's output (q, k, v,
    o; the MLP's), the attention kernel's output and its fp32 log-sum-exp per head."""
    h, kv, inner = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    mlp = 2 * inner + h if cfg.architecture == "llama" else inner + h
    return act_bytes * (2 * h + 2 * kv + mlp) + act_bytes * h + 4 * cfg.num_attention_heads


def block_params(cfg: ModelConfig) -> int:
    """Parameters inside the transformer blocks (what FSDP2 gathers block by block)."""
    return cfg.num_hidden_layers * count_params(cfg).per_layer


# Which of weights, gradients and optimizer state each train.json `parallelism` shards across the ranks
# (nanopt.train.parallel); "fsdp_offload" keeps its shards in host memory.
SHARDED_STATES = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (True, True, True),
                  "fsdp": (True, True, True), "fsdp_offload": (True, True, True)}
OFFLOADED = ("fsdp_offload",)


def hidden_matrix_params(cfg: ModelConfig) -> int:
    """Parameters of the 2-D projection weights inside the blocks (no biases): what Muon updates
    (nanopt.train.optim.is_hidden_matrix); embeddings, head, norms and biases stay with AdamW."""
    h, kv, inner = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    mlp_matrices = 3 if cfg.architecture == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: up, down
    return cfg.num_hidden_layers * (2 * h * h + 2 * h * kv + mlp_matrices * h * inner)


# torchao's 8-bit AdamW: two one-byte moments and an fp32 scale per block of 256 values each (the few tensors under
# 4096 values, norms and biases, keep fp32 moments: not counted).
ADAM_8BIT_BYTES = 2 + 2 * 4 / 256


def states_only(params: int, shard: int = 1, activations_per_sequence: int = 0, muon_params: int = 0,
                parallelism: str = "fsdp", adam_bytes: float = 8) -> MemoryEstimate:
    """fp32 weights and gradients (4 bytes each per parameter) and AdamW's two moments (8), or Muon's one momentum
    buffer (4) for the `muon_params` it updates, over `shard` ranks as `parallelism` spreads them (SHARDED_STATES),
    plus the runtime overhead: all that can be said from a bare parameter count."""
    optimizer = adam_bytes * (params - muon_params) + 4 * muon_params
    weights, gradients, states = (math.ceil(total / (shard if sharded else 1)) for total, sharded
                                  in zip((4 * params, 4 * params, optimizer), SHARDED_STATES[parallelism],
                                         strict=True))
    host = 0
    if parallelism in OFFLOADED:
        host, weights, gradients, states = weights + gradients + states, 0, 0, 0
    return MemoryEstimate(weights=weights, gradients=gradients, optimizer=states,
                          activations_per_sequence=activations_per_sequence, runtime_overhead=RUNTIME_OVERHEAD_BYTES,
                          host=host)
