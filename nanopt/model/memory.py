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
from nanopt.model.loss_chunks import loss_chunk_rows
from nanopt.model.memory_loss import loss_buffer_bytes, loss_bytes_per_token, loss_chunk_row_bytes

# Bytes the CUDA context, cuBLAS workspaces and allocator rounding take before the first tensor. Measured on an
# H100 (torch 2.11, CUDA 13): a context of 0.75 GiB, and about 0.065 GiB the allocator holds beyond every tensor the
# model counts (the four eager peaks of bench/gpusession's memory step); the calibration in `nanopt find-batch`
# reports the error of this model.
RUNTIME_OVERHEAD_BYTES = 1 << 30
# A CPU training process's resident memory beside the tensors the model counts: torch, nanopt and their libraries
# (torch 2.13's CPU wheel: 358 MiB after the imports in a fresh `make install`, 390 once a session is built; an older
# install of the same wheel held 56 MiB fewer of the libraries' file pages) and the loss chart `nanopt train` draws
# after each evaluation (matplotlib: about 60 MiB for the first, its caches full at about 90).
CPU_RUNTIME_OVERHEAD_BYTES = 480 << 20
# On the CPU a step's resident peak holds more than the activations autograd keeps (counted exactly: tests), for
# the backward's transient gradients and the blocks glibc keeps once they are freed: the peak resident memory of 30
# steps, less the built session's, over the model's activations and loss, was 1.60, 1.67 and 1.44 for 0.9M, 0.3M and
# 6.6M-parameter models (the demo; the README's two-minute plan; 6 x 256 at 16 x 512 tokens).
CPU_ACTIVATION_FACTOR = 1.5


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak is the largest of three moments: the forward's, in the loss (every activation kept for backward,
    the loss's chunk transients, and the gradients only when an earlier micro-batch of the step left them), the
    backward's (every gradient, and under activation checkpointing one block rebuilt with the inputs kept), and a
    log step's optimizer update with run health on (every gradient, and the copy of the weights the health probe
    takes before the update: nanopt.train.health.probe)."""

    weights: int
    gradients: int
    optimizer: int
    activations_per_sequence: int  # kept at the forward's peak: the blocks', the final norm's and the loss's
    runtime_overhead: int
    # The loss's fp32 head gradient, formed in forward and held until backward, and its bf16 copy there (per GPU,
    # never sharded: the loss runs on the gathered head).
    loss_buffers: int = 0
    # "zero2": every block's gathered weights, kept from forward to backward.
    gathered: int = 0
    # "fsdp_offload": the sharded weights, gradients and optimizer state, in host memory instead (per rank).
    host: int = 0
    # Eager autocast: the compute-dtype copies of the blocks' projection weights, each saved by its matmul (and
    # held by autocast's cache) from forward to backward.
    weight_copies: int = 0
    # The loss's transients per row of one chunk (loss_chunk_row_bytes); the chunk's rows depend on the micro-batch
    # (nanopt.model.loss_chunks: an eighth of the rows, at most 1 GiB of fp32 logits).
    loss_chunk_row_bytes: int = 0
    seq_len: int = 0
    vocab_size: int = 0
    # Sequences per rank in one optimizer step: a smaller micro-batch accumulates, and the second and later
    # micro-batches run forward with the gradients allocated. 0: every step is one micro-batch, whatever its size.
    step_sequences: float = math.inf
    # Activation checkpointing: per sequence at a rebuilt block's backward (every kept input, one block's
    # activations and the residual stream's fp32 gradient), while all gradients may exist; 0 without it.
    recompute_per_sequence: int = 0
    # Run health's copy of this GPU's weights around a log step's update; 0 with `health` off, or with the weights
    # in host memory (fsdp_offload: the copy is too).
    health_snapshot: int = 0
    # What the peak holds per byte of the micro-batch's counted activations and loss transients: 1 on a GPU (its
    # caching allocator, calibrated), CPU_ACTIVATION_FACTOR on the CPU (the process's resident memory).
    resident_factor: float = 1.0

    def gradients_in_forward(self, micro_batch_size: int) -> bool:
        return micro_batch_size < self.step_sequences

    def fixed(self, micro_batch_size: int = 1) -> int:
        """What the forward's peak holds besides what grows with the micro-batch."""
        gradients = self.gradients if self.gradients_in_forward(micro_batch_size) else 0
        return (self.weights + self.optimizer + self.runtime_overhead + self.loss_buffers + self.gathered
                + self.weight_copies + gradients)

    def loss_chunk_bytes(self, micro_batch_size: int) -> int:
        if not self.loss_chunk_row_bytes:
            return 0
        return self.loss_chunk_row_bytes * loss_chunk_rows(micro_batch_size * self.seq_len, self.vocab_size)

    def total(self, micro_batch_size: int) -> int:
        growing = micro_batch_size * self.activations_per_sequence + self.loss_chunk_bytes(micro_batch_size)
        forward = self.fixed(micro_batch_size) + int(self.resident_factor * growing)
        backward = (self.weights + self.gradients + self.optimizer + self.runtime_overhead + self.gathered
                    + int(self.resident_factor * micro_batch_size * self.recompute_per_sequence))
        update = self.weights + self.gradients + self.optimizer + self.runtime_overhead + self.health_snapshot
        return max(forward, backward, update)

    def max_micro_batch(self, device_bytes: int) -> int:
        """The largest micro-batch whose total fits, by bisection: the total grows with the micro-batch (but for
        one dip, where the loss goes from one chunk of a few sequences to eight: treated as if it did not)."""
        if self.total(1) > device_bytes:
            return 0
        fits, fails = 1, 2 + device_bytes // max(1, self.activations_per_sequence, self.recompute_per_sequence)
        while fails - fits > 1:
            middle = (fits + fails) // 2
            fits, fails = (middle, fails) if self.total(middle) <= device_bytes else (fits, middle)
        return fits

    def to_dict(self, micro_batch_size: int) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations_per_sequence": self.activations_per_sequence,
                "runtime_overhead": self.runtime_overhead, "loss_buffers": self.loss_buffers,
                "gathered": self.gathered, "host": self.host, "weight_copies": self.weight_copies,
                "health_snapshot": self.health_snapshot,
                "loss_chunk": self.loss_chunk_bytes(micro_batch_size),
                "gradients_in_forward": self.gradients_in_forward(micro_batch_size),
                "total": self.total(micro_batch_size)}


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


def activation_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int, compiled: bool,
                                         stacked: bool = False) -> int:
    """Tensors one transformer block saves for backward, per token, with a flash-style attention kernel.

    The residual stream stays in fp32 (the master weights are fp32 and autocast keeps additions in fp32); the
    matmul outputs are in the compute dtype (`act_bytes`). Under autocast (act_bytes < 4) eager and compiled
    differ: eager_block_bytes and compiled_block_bytes. `stacked`: q, k, v (and gate, up) as one GEMM each
    (nanopt.model.stacked): the same outputs, one input cast per norm in eager.
    """
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    residual = 2 * 4 * h  # block input and the mid-block residual, fp32
    # q, k, v as the attention kernel saves them (llama's after RoPE), its output (o_proj's input) and its fp32
    # log-sum-exp per head
    attention = act_bytes * (h + 2 * kv) + act_bytes * h + 4 * cfg.num_attention_heads
    if compiled:
        return residual + attention + compiled_block_bytes(cfg, act_bytes)
    return residual + attention + eager_block_bytes(cfg, act_bytes, stacked)


def projections_reading_each_norm(cfg: ModelConfig, stacked: bool = False) -> tuple[int, int]:
    """(matmuls reading the attention norm's output, matmuls reading the MLP norm's): q, k, v; gate and up, or fc.
    Stacked, one each."""
    if stacked:
        return 1, 1
    return 3, 2 if cfg.architecture == "llama" else 1


def eager_block_bytes(cfg: ModelConfig, act_bytes: int, stacked: bool = False) -> int:
    """Per token, what an eager block saves besides its residual stream and attention, tensor by tensor. Checked
    against an H100's allocated peaks (bench/gpusession memory step: GPT-2 small at 32 x 1024 and Llama 1B at
    8 x 2048, each with and without checkpointing, within 0.07 GiB of what torch.cuda.max_memory_allocated saw).

    - Norms, computed in fp32 whatever the precision (CUDA autocast runs layer_norm in fp32; nanopt's RMSNorm
      upcasts): LayerNorm saves its input (the residual, counted) and a mean and rstd per token (8 bytes);
      nanopt's RMSNorm saves its fp32 normalized values for the gain's gradient (4h) and 1/rms (4 bytes).
    - The projections' input: the norm's output is fp32, and autocast casts a non-leaf tensor anew at every matmul
      (it caches only the weights' casts), so each of q, k, v (and gate and up) saves its own copy in the compute
      dtype: 3 copies at the attention, 2 (llama) or 1 (gpt2) at the MLP. Without autocast (fp32) they share the
      one fp32 output: one copy per norm.
    - MLP: llama's gate and up outputs, silu(gate) (saved by the product) and the product (down_proj's input):
      4 x inner; gpt2's fc output (GELU's input: the tanh form is one kernel that saves only its input) and the GELU
      output (c_proj's input): 2 x inner. Dropout at p = 0 returns its input, so it saves no mask.

    GPT-2 small, bf16 (h 768, inner 3072, 12 heads): 8h residual 6144 + norms 16 + 4 x 2h casts 6144 + attention
    6192 + MLP 12288 = 30,784 bytes per token per layer. Llama 1B (h 2048, kv 512, inner 8192, 32 heads): residual
    16,384 + norms 16,392 + 5 x 2h casts 20,480 + attention 10,368 + MLP 65,536 = 129,160.
    """
    h, inner = cfg.hidden_size, cfg.intermediate_size
    if cfg.architecture == "llama":
        norms = 2 * (4 * h + 4)
        mlp = 4 * act_bytes * inner
    else:
        norms = 2 * 8
        mlp = 2 * act_bytes * inner
    casts = sum(projections_reading_each_norm(cfg, stacked)) if act_bytes < 4 else 2
    inputs = casts * act_bytes * h
    return norms + inputs + mlp + qk_norm_bytes(cfg, act_bytes, compiled=False)


def compiled_block_bytes(cfg: ModelConfig, act_bytes: int) -> int:
    """Per token, what a compiled block saves besides its residual stream and attention: Inductor fuses the norms'
    and the activation function's intermediates and computes each norm's output once. Not derived tensor by tensor
    (the partitioner decides what it recomputes): within 3% of an H100's compiled peaks for GPT-2 small and Llama 1B
    (bench/RESULTS.md)."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    norms = (2 if cfg.architecture == "llama" else 1) * act_bytes * h
    mlp = act_bytes * (3 * inner if cfg.architecture == "llama" else 2 * inner)
    return norms + mlp + qk_norm_bytes(cfg, act_bytes, compiled=True)


def qk_norm_bytes(cfg: ModelConfig, act_bytes: int, compiled: bool) -> int:
    """qk_norm: the per-head RMSNorm's input in fp32, its output in the compute dtype and its fp32 1/rms per head,
    for queries and keys; compiled, only the projection's output is kept (fused)."""
    if not cfg.qk_norm:
        return 0
    width = cfg.hidden_size + cfg.num_key_value_heads * cfg.head_dim
    if compiled:
        return act_bytes * width
    return (4 + act_bytes) * width + 4 * (cfg.num_attention_heads + cfg.num_key_value_heads)


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


def weight_copy_bytes(cfg: ModelConfig, act_bytes: int, compiled: bool, parallelism: str, stacked: bool = False,
                      kept_blocks: int | None = None, copies: bool = False) -> int:
    """Eager autocast on replicated weights (ddp, zero1): every projection's weight cast to the compute dtype is
    saved by its matmul for backward, so all the blocks' copies are alive at the forward's peak (GPT-2 small:
    2 x 84.9M = 0.16 GiB; Llama 1B: 2 x 973M = 1.81 GiB). Compiled, the cast is recomputed from the fp32 weight in
    backward; FSDP2 gathers the weights in the compute dtype already and frees them after each block.

    `stacked` (nanopt.model.stacked): the concatenated q/k/v (and gate/up) weight is no leaf, so autocast does not
    cache its cast: the copy is saved by the `kept_blocks` blocks that are not checkpointed (default: all). Where
    nothing is cast (fp32; FSDP2's gathered weights) eager and compiled alike keep the concatenation itself (Inductor
    saves it rather than the weights it came from); compiled under autocast, it is recomputed as the casts are.

    `copies` (train.json bf16_weight_copies, nanopt.model.weight_copies): the blocks' weights in bf16, kept for the
    whole run, eager or compiled; they are what the GEMMs save for backward (stacked ones too), so no other copy."""
    cast = act_bytes < 4 and parallelism in ("ddp", "zero1")
    if copies and cast:
        return act_bytes * hidden_matrix_params(cfg)
    cached = act_bytes * hidden_matrix_params(cfg) if cast and not compiled else 0
    if not stacked or (cast and compiled):
        return cached
    per_block = act_bytes * stacked_params_per_layer(cfg)
    kept = cfg.num_hidden_layers if kept_blocks is None else kept_blocks
    return cached - (per_block * cfg.num_hidden_layers if cached else 0) + per_block * kept


def stacked_params_per_layer(cfg: ModelConfig) -> int:
    """Weights a block concatenates when stacked: q, k, v; and llama's gate and up."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    return h * (h + 2 * kv) + (2 * h * cfg.intermediate_size if cfg.architecture == "llama" else 0)


def estimate_memory(cfg: ModelConfig, seq_len: int, *, precision: str, compiled: bool,
                    activation_checkpointing: bool | int | str, parallelism: str, world_size: int,
                    optimizer: str = "adamw", cuda: bool = True, step_sequences: float = math.inf,
                    health: bool = False, stacked: bool = False, weight_copies: bool = False) -> MemoryEstimate:
    """Per-GPU memory of training with AdamW (or Muon, train.json's `optimizer`) and fp32 master weights, at one
    rung of the ladder: train.json's `parallelism` (SHARDED_STATES) and `activation_checkpointing` (any
    granularity: checkpointed_blocks). `step_sequences`: the sequences per rank of one optimizer step; a smaller
    micro-batch accumulates, so the gradients are allocated while the later micro-batches run forward (a step of
    one micro-batch frees them with zero_grad(set_to_none=True) before its forward; 0: find-batch's trials and the
    bench, a step of one micro-batch whatever its size).

    On CUDA (`cuda`) attention costs what the SDPA kernel the shape and precision get holds (attention_kernel):
    the math fallback adds its [H, T, T] scores per layer and, at the peak of one layer's backward, two more
    score-sized tensors. On the CPU, SDPA's flash kernel takes every precision and grouping.

    Weights, gradients and the two Adam moments are fp32 (4 bytes each per parameter); Muon keeps one fp32
    momentum buffer for the hidden matrices it updates instead. Eager autocast keeps the blocks' weight copies
    (weight_copy_bytes); zero2 keeps every block's gathered weights (`gathered`). With run `health` on, a log
    step copies the weights around its update (`health_snapshot`). `stacked`: the model's stacked projections
    (Transformer.stack_projections), which change the eager casts and the weight copies; `weight_copies` the bf16
    weight copies (train.json bf16_weight_copies), which replace them.
    """
    parallelism = parallelism if world_size > 1 else "ddp"  # one process shards nothing (nanopt.train.parallel.wrap)
    act_bytes = 4 if precision == "fp32" else 2
    math_attention = cuda and attention_kernel(cfg, precision) == "math"
    extra = math_attention_bytes_per_token_per_layer(cfg, act_bytes, seq_len) if math_attention else 0
    if cuda:
        extra += expanded_kv_bytes(cfg, act_bytes)
    kept, recomputed = block_activation_bytes_per_token(cfg, act_bytes, compiled, activation_checkpointing, extra,
                                                        stacked)
    per_sequence_extra = document_mask_bytes(cfg, act_bytes, seq_len)
    if math_attention:  # the scores' gradient and the probabilities' gradient in one layer's backward
        per_sequence_extra += 2 * act_bytes * cfg.num_attention_heads * seq_len * seq_len
    forward = (kept + loss_bytes_per_token(cfg, act_bytes, compiled)) * seq_len + per_sequence_extra
    # A rebuilt block's backward: every kept input, the block, and the fp32 gradient of the residual stream.
    backward = (kept + recomputed + 4 * cfg.hidden_size) * seq_len + per_sequence_extra if recomputed else 0
    muon_params = hidden_matrix_params(cfg) if optimizer == "muon" else 0
    states = states_only(count_params(cfg).total, world_size, activations_per_sequence=forward,
                         muon_params=muon_params, parallelism=parallelism,
                         adam_bytes=ADAM_8BIT_BYTES if optimizer == "adamw8bit" else 8, health=health)
    gathered = act_bytes * block_params(cfg) if parallelism == "zero2" else 0
    # a checkpointed block (every one under "selective") keeps no stacked weight copy for backward
    uncheckpointed = cfg.num_hidden_layers - len(checkpointed_blocks(activation_checkpointing, cfg.num_hidden_layers))
    return dataclasses.replace(states, loss_buffers=loss_buffer_bytes(cfg, act_bytes), gathered=gathered,
                               runtime_overhead=RUNTIME_OVERHEAD_BYTES if cuda else CPU_RUNTIME_OVERHEAD_BYTES,
                               weight_copies=weight_copy_bytes(cfg, act_bytes, compiled, parallelism, stacked,
                                                               uncheckpointed, weight_copies),
                               loss_chunk_row_bytes=loss_chunk_row_bytes(cfg, act_bytes, compiled, cuda),
                               seq_len=seq_len, vocab_size=cfg.vocab_size, step_sequences=step_sequences,
                               recompute_per_sequence=backward, resident_factor=1.0 if cuda else CPU_ACTIVATION_FACTOR)


SELECTIVE = "selective"


def checkpointed_blocks(setting: bool | int | str, num_blocks: int) -> list[int]:
    """The indices of the blocks whose activations are recomputed in backward (train.json's
    `activation_checkpointing`: false, true, "selective", or k for every k-th block: k, 2k, ...)."""
    if setting is False:
        return []
    every = 1 if setting is True or setting == SELECTIVE else int(setting)
    return [index for index in range(num_blocks) if (index + 1) % every == 0]


def block_activation_bytes_per_token(cfg: ModelConfig, act_bytes: int, compiled: bool,
                                     checkpointing: bool | int | str, extra_per_layer: int = 0,
                                     stacked: bool = False) -> tuple[int, int]:
    """(bytes the blocks keep for backward at the end of forward, bytes of the one block rebuilt at a time in
    backward), per token. A checkpointed block keeps only its fp32 input; a selectively checkpointed one its input
    and its matmul and attention outputs."""
    per_layer = activation_bytes_per_token_per_layer(cfg, act_bytes, compiled, stacked) + extra_per_layer
    layers = cfg.num_hidden_layers
    recomputed = len(checkpointed_blocks(checkpointing, layers))
    block_input = 4 * cfg.hidden_size
    if checkpointing == SELECTIVE:
        return layers * (block_input + selective_bytes_per_token_per_layer(cfg, act_bytes)), per_layer
    return (layers - recomputed) * per_layer + recomputed * block_input, per_layer if recomputed else 0


def selective_bytes_per_token_per_layer(cfg: ModelConfig, act_bytes: int) -> int:
    """What selective checkpointing keeps of a block (nanopt.train.parallel.recompute): every projection's output (q, k,
    v, o; the MLP's), the attention kernel's output and its fp32 log-sum-exp per head."""
    h, kv, inner = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    mlp = 2 * inner + h if cfg.architecture == "llama" else inner + h
    return act_bytes * (2 * h + 2 * kv + mlp) + act_bytes * h + 4 * cfg.num_attention_heads


def block_params(cfg: ModelConfig) -> int:
    """Parameters inside the transformer blocks (what FSDP2 gathers block by block)."""
    return cfg.num_hidden_layers * count_params(cfg).per_layer


# Which of weights, gradients and optimizer state each train.json `parallelism` shards across the ranks
# (nanopt.train.parallel.wrap); "fsdp_offload" keeps its shards in host memory.
SHARDED_STATES = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (True, True, True),
                  "fsdp": (True, True, True), "fsdp_offload": (True, True, True)}
OFFLOADED = ("fsdp_offload",)


def hidden_matrix_params(cfg: ModelConfig) -> int:
    """Parameters of the 2-D projection weights inside the blocks (no biases): what Muon updates
    (nanopt.train.optim.optimizer.is_hidden_matrix); embeddings, head, norms and biases stay with AdamW."""
    h, kv, inner = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    mlp_matrices = 3 if cfg.architecture == "llama" else 2  # SwiGLU: gate, up, down; GELU MLP: up, down
    return cfg.num_hidden_layers * (2 * h * h + 2 * h * kv + mlp_matrices * h * inner)


# torchao's 8-bit AdamW: two one-byte moments and an fp32 scale per block of 256 values each (the few tensors under
# 4096 values, norms and biases, keep fp32 moments: not counted).
ADAM_8BIT_BYTES = 2 + 2 * 4 / 256


def states_only(params: int, shard: int = 1, activations_per_sequence: int = 0, muon_params: int = 0,
                parallelism: str = "fsdp", adam_bytes: float = 8, health: bool = False) -> MemoryEstimate:
    """fp32 weights and gradients (4 bytes each per parameter) and AdamW's two moments (8), or Muon's one momentum
    buffer (4) for the `muon_params` it updates, over `shard` ranks as `parallelism` spreads them (SHARDED_STATES),
    with run `health`'s copy of the weights at a log step's update, plus the runtime overhead: all that can be said
    from a bare parameter count."""
    optimizer = adam_bytes * (params - muon_params) + 4 * muon_params
    weights, gradients, states = (math.ceil(total / (shard if sharded else 1)) for total, sharded
                                  in zip((4 * params, 4 * params, optimizer), SHARDED_STATES[parallelism],
                                         strict=True))
    snapshot = weights if health else 0
    host = 0
    if parallelism in OFFLOADED:  # everything, the copy too, in host memory
        host, weights, gradients, states, snapshot = weights + gradients + states + snapshot, 0, 0, 0, 0
    return MemoryEstimate(weights=weights, gradients=gradients, optimizer=states,
                          activations_per_sequence=activations_per_sequence, runtime_overhead=RUNTIME_OVERHEAD_BYTES,
                          host=host, health_snapshot=snapshot)
