"""Downstream tasks in the training loop: train.json's downstream_tasks, scored every downstream_interval steps
(default: at every in-loop evaluation) inside the eval phase, so their time shows in the phase table and counts
in the evaluation-cost warning; written into the `eval` record of metrics.jsonl (and so to TensorBoard / W&B) as
task_NAME_METRIC keys, with downstream_s, their seconds.

The scoring itself lives in nanopt.evaluate.tasks, a layer above this one: the CLI hands the loop a hook
(TrainOptions.downstream) that scores. A task whose records cannot be loaded is disabled with a warning and the
run goes on; it never stops or loses a training run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from nanopt.runtime import Runtime
from nanopt.train.observe.metrics import iter_metrics
from nanopt.train.observe.phases import occasions
from nanopt.train.observe.task_curves import TASK_PREFIX


class DownstreamHook(Protocol):
    def __call__(self, model: torch.nn.Module, rt: Runtime, dataset: Any, micro_batch_size: int,
                 seq_len: int) -> tuple[dict[str, float], list[str]]:
        """Flat metrics (task_NAME_METRIC: value, the same on every rank) and warnings to show (rank 0)."""
        ...


def downstream_interval(train: Any) -> int:
    """Steps between downstream scorings: train.json's downstream_interval, by default the eval interval."""
    return train.eval_interval if train.downstream_interval is None else train.downstream_interval


def score_downstream(s: Any) -> dict[str, float]:
    """The downstream metrics for this evaluation's record; {} when no tasks are set, no hook was given, or this
    evaluation's step is not a multiple of downstream_interval (the last step always scores)."""
    hook, interval, step = s.opts.downstream, downstream_interval(s.run.train), s.state.step
    if hook is None or not s.run.train.downstream_tasks or not interval:
        return {}
    if step % interval and step != s.total_steps:
        return {}
    started = time.perf_counter()
    flat, warnings = hook(s.prepared.model, s.rt, s.dataset, s.run.train.micro_batch_size, s.run.seq_len)
    seconds = time.perf_counter() - started
    s.downstream_last = (step, seconds)
    if s.rt.is_main:
        for warning in warnings:
            s.observer.note(f"warning: {warning}")
    return {**flat, "downstream_s": seconds}


def typical_eval_seconds(s: Any) -> float:
    """The latest evaluation's seconds as the cost warning should weigh them: the downstream tasks' time spread
    evenly over the evaluations between two scorings (scored every downstream_interval steps, not every
    eval_interval), so an interval with tasks and one without are judged alike."""
    loss_eval_s, tasks_s = _latest_evaluation(s)
    return loss_eval_s + s.run.train.eval_interval / max(downstream_interval(s.run.train), 1) * tasks_s


def tasks_seconds_left(s: Any) -> tuple[float, float]:
    """For the live ETA: (the latest evaluation's seconds without its downstream tasks, the tasks' seconds for the
    scorings left in the run). The tasks run every downstream_interval steps, not at every evaluation: the latest
    evaluation's duration alone would charge them to every evaluation left, or to none."""
    loss_eval_s, tasks_s = _latest_evaluation(s)
    interval = downstream_interval(s.run.train)
    left = occasions(interval, s.state.step, s.total_steps) if tasks_s and interval and s.run.train.eval_interval \
        else 0
    return loss_eval_s, left * tasks_s


def _latest_evaluation(s: Any) -> tuple[float, float]:
    """(the latest evaluation's seconds without downstream tasks, the latest scoring's seconds; 0.0 without tasks).
    The scoring is part of the latest evaluation's time when it was scored at that evaluation's step."""
    eval_s = s.clock.last["eval"] or 0.0
    if s.downstream_last is None:
        return eval_s, 0.0
    scored_at, tasks_s = s.downstream_last
    return (max(eval_s - tasks_s, 0.0) if scored_at == s.state.val_step else eval_s), tasks_s


def downstream_advice(s: Any) -> str:
    """The cost warning's last words when downstream tasks take part of evaluation's time."""
    if s.downstream_last is None:
        return ""
    return (f"; downstream tasks took {s.downstream_last[1]:.2f} s every {downstream_interval(s.run.train)} "
            "steps: a larger downstream_interval or fewer downstream_examples would help too")


def run_downstream(s: Any) -> dict[str, Any] | None:
    """For the end-of-run summary (rank 0, which writes metrics.jsonl): the run's latest downstream scores."""
    if not (s.rt.is_main and s.run.train.downstream_tasks):
        return None
    return latest_downstream(iter_metrics(s.run.run_dir))


def latest_downstream(records: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest eval record's downstream metrics ({"step": N, "task_...": value, ...}), None if none has any; read
    forward, keeping only the newest such record, so a long metrics.jsonl is never held whole."""
    newest = None
    for record in records:
        if record.get("kind") == "eval" and any(k.startswith(TASK_PREFIX) for k in record):
            newest = record
    if newest is None:
        return None
    return {"step": newest.get("step"), **{k: v for k, v in newest.items() if k.startswith(TASK_PREFIX)}}

