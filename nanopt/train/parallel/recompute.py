"""Activation checkpointing with a granularity (train.json's `activation_checkpointing`), as torchtitan offers it:

false        nothing recomputed: every block's activations are kept for backward.
true         every block recomputed: only each block's input is kept (about a third more compute).
k (integer)  every k-th block (blocks k, 2k, ...: indices k-1, 2k-1, ...) recomputed, the others keep theirs:
             1 is `true`; 2 keeps half the blocks' activations for about a sixth more compute.
"selective"  every block, but the outputs of the matrix multiplications and of attention are saved and only the
             cheap element-wise operations (norms, activation functions, RoPE, casts) are recomputed.

Applied by replacing each chosen block's `forward` on the instance: parameter names (the checkpoint's keys) stay
unchanged, and the model module stays free of training concerns.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from nanopt.model.memory import SELECTIVE, checkpointed_blocks


def apply_activation_checkpointing(model: torch.nn.Module, setting: bool | int | str) -> None:
    context_fn = _selective_contexts if setting == SELECTIVE else None
    for index in checkpointed_blocks(setting, len(model.layers)):
        block = model.layers[index]
        block.forward = functools.partial(_checkpointed_forward, block.forward, context_fn)


def _checkpointed_forward(forward: Any, context_fn: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)


def _saved_ops() -> set[Any]:
    """The operations whose outputs selective checkpointing keeps: the matmuls and the attention kernels (the
    expensive ones to recompute), as torchtitan's op-level selective checkpointing lists them."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
