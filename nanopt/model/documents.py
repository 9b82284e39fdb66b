"""Cross-document attention masking (model.json `document_masking`): in a packed sequence of documents separated
by EOS, each token attends only to the earlier tokens of its own document, and positions restart at 0 with each
document, so a packed row computes what each of its documents would alone.

The EOS ends the document it follows (it belongs to it); the next token starts a new one. A row that begins in the
middle of a document (packing splits documents across rows) treats that remainder as a document of its own.

The mask is an additive float mask (0 where allowed, -inf elsewhere) of shape [batch, 1, seq, seq], built once per
forward and shared by every layer: SDPA takes it on every device (the math and memory-efficient kernels; flash
takes no mask), exactly. Cost: seq² mask elements per sequence, and attention computes every block (no sparsity).
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_positions(input_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Per token of [B, T] ids: the index of its document within the row and its position within that document,
    both [B, T] int64."""
    is_eos = input_ids == eos_id
    # a document starts at the row's first token and after each EOS
    starts = torch.zeros_like(is_eos)
    starts[:, 0] = True
    starts[:, 1:] = is_eos[:, :-1]
    document = starts.long().cumsum(dim=1) - 1
    index = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return document, index - first


def document_mask(document: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, 1, T, T] additive mask: 0 where a query may see a key (same document, key not after the query), -inf
    elsewhere."""
    seq = document.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=document.device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (queries and keys come out of autocast matmuls),
    else x's. SDPA requires the additive mask in the queries' dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
