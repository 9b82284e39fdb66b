"""Downstream tasks in the training loop: train.json's downstream_tasks, scored at each in-loop evaluation, inside
its eval phase (so their time shows in the phase table and its cost warning), written into the `eval` record of
metrics.jsonl (and so to TensorBoard / W&B) as task_NAME_METRIC keys.

The scoring itself lives in nanopt.evaluate.tasks, a layer above this one: the CLI hands the loop a hook
(TrainOptions.downstream) that scores. A task whose records cannot be loaded is disabled with a warning and the
run goes on; it never stops or loses a training run.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from nanopt.runtime import Runtime


class DownstreamHook(Protocol):
    def __call__(self, model: torch.nn.Module, rt: Runtime, dataset: Any, micro_batch_size: int,
                 seq_len: int) -> tuple[dict[str, float], list[str]]:
        """Flat metrics (task_NAME_METRIC: value, the same on every rank) and warnings to show (rank 0)."""
        ...


def score_downstream(s: Any) -> dict[str, float]:
    """The downstream metrics for this evaluation's record; {} when no tasks are set or no hook was given."""
    hook = s.opts.downstream
    if hook is None or not s.run.train.downstream_tasks:
        return {}
    flat, warnings = hook(s.prepared.model, s.rt, s.dataset, s.run.train.micro_batch_size, s.run.seq_len)
    if s.rt.is_main:
        for warning in warnings:
            s.observer.note(f"warning: {warning}")
    return flat
