"""How the loss splits a micro-batch's rows into chunks: shared by the loss (nanopt.model.loss) and the
memory model (nanopt.model.memory), and free of torch so `nanopt estimate` stays fast.

The loss never holds [rows, vocab] fp32 logits for backward: it works through chunks of rows and forms each
chunk's gradients in the same pass. A few chunks per micro-batch keep the GEMMs large (M = thousands of rows,
a multiple of the 128-row tile), and a byte cap bounds the per-chunk transients of a very large micro-batch. When
the whole fp32 logits are small, one chunk covers every row: the plain full-logits cross-entropy, which autograd
and torch.compile handle best.
"""

from __future__ import annotations

LOSS_CHUNKS = 8  # chunks per micro-batch when the logits are large
MAX_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk at most (Llama-1B, vocab 128256: 2048 rows)
FULL_LOGITS_MAX_BYTES = 256 << 20  # fp32 logits of the whole micro-batch up to this: no chunking
ROW_ALIGN = 128  # GEMM tile height: chunk sizes are multiples of it


def loss_chunk_rows(rows: int, vocab_size: int) -> int:
    """Rows per chunk for `rows` rows of logits over `vocab_size` classes; `rows` itself means no chunking."""
    row_bytes = 4 * vocab_size
    if rows * row_bytes <= FULL_LOGITS_MAX_BYTES:
        return rows
    by_count = _round_up(-(-rows // LOSS_CHUNKS), ROW_ALIGN)
    by_bytes = max(ROW_ALIGN, MAX_CHUNK_BYTES // row_bytes // ROW_ALIGN * ROW_ALIGN)
    return min(rows, by_count, by_bytes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
