"""Downstream task accuracy on the run's loss chart (nanopt.train.observe.metrics.loss_chart): from metrics.jsonl's eval
records, whose task_NAME_METRIC keys nanopt.train.downstream writes."""

from __future__ import annotations

from typing import Any

TASK_PREFIX = "task_"  # the eval record's keys that hold downstream metrics


def accuracy_curves(records: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Per task ("hellaswag acc_norm"), its accuracy in percent against tokens, from the eval records: acc_norm
    where the task has it (the harness's headline number), else acc."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        if r.get("kind") != "eval" or "tokens" not in r:
            continue
        for key in r:
            if key.startswith(TASK_PREFIX) and key.endswith("_acc"):
                name = key[len(TASK_PREFIX):-len("_acc")]
                metric = "acc_norm" if f"{key}_norm" in r else "acc"
                tokens, values = curves.setdefault(f"{name} {metric}", ([], []))
                tokens.append(r["tokens"])
                values.append(100 * r[f"{TASK_PREFIX}{name}_{metric}"])
    return curves


def draw_task_accuracy(ax: Any, records: list[dict[str, Any]]) -> None:
    """The downstream tasks' accuracy on the loss chart, against a right-hand axis in percent (nothing without
    downstream records)."""
    curves = accuracy_curves(records)
    if not curves:
        return
    right = ax.twinx()
    for index, (label, (tokens, values)) in enumerate(curves.items()):
        right.plot(tokens, values, "s--", color=f"C{(index + 2) % 10}", markersize=3, linewidth=1, label=label)
    right.set_ylabel("downstream accuracy (%)")
    right.set_ylim(0, 100)
    right.legend(fontsize="small", loc="upper right")
