"""Running out of memory during training: one line that says what ran out, what is kept and what to change, instead
of a traceback (nanopt.train.loop turns the error into this after the background save in flight has finished)."""

from __future__ import annotations

from typing import Any

from nanopt.errors import NanoptError


class OutOfMemoryError(NanoptError):
    """The device (or the host) could not hold a step of this run at this micro-batch size."""


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA's caching allocator), cuBLAS failing to allocate its workspace, or the CPU
    allocator refusing a request."""
    import torch

    text = str(exc).lower()
    return (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "cublas_status_alloc_failed" in text
            or "can't allocate memory" in text)


def out_of_memory_error(exc: BaseException, device: Any, step: int | None, latest: str) -> OutOfMemoryError:
    """`step`: the optimizer step that ran out (None: while setting up); `latest`: the newest complete checkpoint."""
    where = f"at step {step}" if step is not None else "while setting up"
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return OutOfMemoryError(
        f"out of memory on {device} {where} ({detail})",
        "lower micro_batch_size in train.json (`nanopt find-batch RUN --write` finds the largest that fits; "
        "global_batch_tokens stays, accumulation makes up the rest), or set \"activation_checkpointing\": true; "
        f"complete checkpoints are kept (latest: {latest}): run the same command with --allow-changed to resume")
