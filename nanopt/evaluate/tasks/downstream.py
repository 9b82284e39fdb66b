"""Score a loaded model on downstream tasks: load each task's records (rank 0, shared with every rank), render
them as the harness does, score every pair on all ranks, and sum up per task. A task that cannot be loaded is a
DataError on every rank at once (no rank is left waiting in a collective).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanopt.errors import DataError, NanoptError
from nanopt.evaluate.tasks.catalog import TASKS, Example, render
from nanopt.evaluate.tasks.metrics import centered_mean, task_metrics
from nanopt.evaluate.tasks.scorer import encode_pairs, score_requests
from nanopt.evaluate.tasks.sources import load_records
from nanopt.runtime import Runtime, broadcast_object


@dataclass(frozen=True)
class TaskOptions:
    names: tuple[str, ...]
    limit: int | None = None  # the first `limit` examples of each task; None: all
    task_data: Path | None = None  # local task files instead of the hub


def evaluate_tasks(model: torch.nn.Module, rt: Runtime, tokenizer: Any, eos_id: int, opts: TaskOptions,
                   micro_batch_size: int) -> dict[str, Any]:
    """{"tasks": {name: metrics}, "centered_mean": ...}; the same on every rank."""
    max_positions = model_positions(model)
    results = {}
    for name in opts.names:
        started = time.perf_counter()
        examples, source = load_examples(rt, name, opts)
        pairs = [pair for example in examples for pair in example.pairs]
        requests = encode_pairs(tokenizer, pairs, eos_id, max_positions)
        scores = score_requests(model, rt, requests, micro_batch_size, max_positions)
        results[name] = {**task_metrics(TASKS[name], examples, scores), "source": source,
                         "truncated": sum(len(r.tokens) == max_positions + 1 for r in requests),
                         "seconds": time.perf_counter() - started}
    return {"tasks": results, "centered_mean": centered_mean(results)}


def load_examples(rt: Runtime, name: str, opts: TaskOptions) -> tuple[Sequence[Example], str]:
    """Rank 0 reads and renders; every rank gets the examples, or the error to raise."""
    loaded: Any = None
    if rt.is_main:
        try:
            records, source = load_records(TASKS[name], opts.task_data, opts.limit)
            loaded = ("ok", render(TASKS[name], records, source), source)
        except NanoptError as exc:
            loaded = ("error", exc.message, exc.hint)
    loaded = broadcast_object(rt, loaded)
    if loaded[0] == "error":
        raise DataError(loaded[1], loaded[2])
    return loaded[1], loaded[2]


def model_positions(model: torch.nn.Module) -> int:
    """max_position_embeddings of a Transformer, through DDP / compile wrappers."""
    inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None) or model
    return int(inner.cfg.max_position_embeddings)
