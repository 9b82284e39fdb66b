"""The memory model's terms for the final norm and the loss (nanopt.model.loss): what they hold per token, per row of
a loss chunk, and whatever the micro-batch. Pure arithmetic, no torch (nanopt.model.memory sums them)."""

from __future__ import annotations

from nanopt.config import ModelConfig


def loss_bytes_per_token(cfg: ModelConfig, act_bytes: int, compiled: bool) -> int:
    """What the final norm and the loss hold per token while the loss's forward works through its chunks: no
    [T, V] logits are kept (nanopt.model.loss); the chunks' own transients are loss_chunk_row_bytes.

    Eager: the final norm's fp32 input (the last residual) and what the norm saves (LayerNorm: a mean and rstd;
    RMSNorm: its fp32 normalized values and 1/rms), its fp32 output and, under autocast, that output in the
    compute dtype (the loss's operand), and the loss's d(hidden) in the compute dtype (saved for backward).
    GPT-2 small, bf16: 4h + 8 + 4h + 2h + 2h = 9,224 bytes; Llama 1B: 4h + 4h + 4 + 4h + 2h + 2h = 32,772.
    Compiled: the final residual, the norm's output and d(hidden) (the norm fused)."""
    h = cfg.hidden_size
    if compiled:
        return 4 * h + 2 * act_bytes * h + 8
    norm = 4 * h + 4 if cfg.architecture == "llama" else 8
    cast = act_bytes * h if act_bytes < 4 else 0
    return 4 * h + norm + 4 * h + cast + act_bytes * h


def loss_chunk_row_bytes(cfg: ModelConfig, act_bytes: int, compiled: bool, cuda: bool) -> int:
    """Per row of one loss chunk, the transients at the loss's forward peak (nanopt.model.loss), the step's peak.

    Eager, in logsumexp of a chunk after the first: this chunk's logits in the compute dtype (2V bf16), the last
    chunk's logits gradient in the compute dtype (2V: its name is rebound only after this chunk's gradient exists),
    the chunk's fp32 logits (4V, later turned into probabilities in place) and logsumexp's fp32 temporary (4V):
    12 bytes per vocabulary entry (in fp32 the matmul's output is the fp32 logits and the gradient: 4 + 4 + 4).
    On CUDA the allocator also keeps one fp32 logits chunk reserved but free at that moment (4V: the loop frees and
    allocates fp32 chunks between allocations of the compute dtype's; measured 0.79 GiB over the allocated peak for
    GPT-2 small at 32 x 1024, where 4V x rows is 0.77 GiB, and 1.05 GiB for Llama 1B at 8 x 2048, 0.98 GiB).
    GPT-2 small at 32 x 1024, 4,096 rows a chunk: 16 x 50,304 x 4,096 = 3.07 GiB.
    Compiled: the chunk's logits in the compute dtype and its fp32 softmax (Inductor fuses the rest)."""
    if compiled:
        return cfg.vocab_size * (4 + act_bytes)
    return cfg.vocab_size * (12 + (4 if cuda else 0))


def loss_buffer_bytes(cfg: ModelConfig, act_bytes: int) -> int:
    """The fp32 head gradient the loss accumulates in forward and keeps until backward (where it is scaled in place
    and handed to the fp32 weight as it is) and, under bf16 autocast, the head's bf16 copy, the loss's operand
    while its forward runs with every activation still alive."""
    head = cfg.vocab_size * cfg.hidden_size
    return 4 * head + (act_bytes * head if act_bytes < 4 else 0)
