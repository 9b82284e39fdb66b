"""Comparing evaluated runs: best test loss first, with what each run took to train (time per phase) and its cost.

Test loss compares runs only when they were evaluated on the same test tokens; bits per byte also compares runs
with different tokenizers (on the same text). `notes` says when a comparison needs that caveat.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nanopt.model.flops import count_params
from nanopt.train.observe.metrics import read_metrics
from nanopt.train.observe.phases import newest_per_session, run_time
from nanopt.train.observe.prediction import compared

if TYPE_CHECKING:
    from nanopt.evaluate.trained import TrainedModel


def ranked(results: list[dict[str, Any]], price_per_hour: float | None = None) -> list[dict[str, Any]]:
    """Results sorted by test loss (a non-finite loss last), each with device-hours and, given a price, cost."""
    rows = [{**result, **training_cost(result, price_per_hour)} for result in results]
    return sorted(rows, key=lambda row: (not math.isfinite(row["test_loss"]), row["test_loss"]))


def training_cost(result: dict[str, Any], price_per_hour: float | None) -> dict[str, Any]:
    """What training to the checkpoint took: every session's wall time per phase (setup, steps, evaluation,
    checkpointing, other) x the ranks it ran on = device-hours, priced at `price_per_hour` or else at the price
    each session trained with. A run trained before nanopt recorded phases has only its step times: device-hours
    are then steps only (and `time` is None)."""
    sessions = result.get("train_sessions")
    measured = run_time(sessions, price_per_hour=price_per_hour) if sessions else None
    if measured is not None:
        time = measured.to_dict()
        return {"time": time, "wall_seconds": time["wall_seconds"], "gpu_hours": time["device_hours"],
                "cost_usd": time["cost_usd"], "cost_excluding_eval_usd": time["cost_excluding_eval_usd"]}
    seconds = result.get("train_seconds")
    gpu_hours = None if seconds is None else seconds / 3600 * result.get("train_world_size", 1)
    cost = gpu_hours * price_per_hour if gpu_hours is not None and price_per_hour is not None else None
    return {"time": None, "wall_seconds": None, "gpu_hours": gpu_hours, "cost_usd": cost,
            "cost_excluding_eval_usd": cost}


def device_hours_label(results: list[dict[str, Any]]) -> str:
    """What the compared runs' device-hours are hours of: "GPU-h" when every run trained on GPUs, "CPU-h" when
    every run trained on a CPU, else "device-h" (mixed, or a checkpoint older than the record of its device)."""
    kinds = {r.get("train_device_type") for r in results}
    return {frozenset({"cuda"}): "GPU-h", frozenset({"cpu"}): "CPU-h"}.get(frozenset(kinds), "device-h")


def notes(results: list[dict[str, Any]]) -> list[str]:
    """Caveats for reading a comparison: different test sets or tokenizers, missing training times."""
    found = []
    if len({r["settings"]["data_fingerprint"] for r in results}) > 1:
        found.append("the runs were evaluated on different test splits: pass --data DIR to evaluate all on one")
    if len({r["settings"]["tokenizer_sha256"] for r in results}) > 1:
        found.append("the runs use different tokenizers: compare bits per byte, not loss or perplexity")
    if len({r["tokens"] for r in results}) > 1:
        found.append("the runs were evaluated on different numbers of test tokens (seq_len, --tokens or the split "
                     "size differ)")
    untimed = [r["run"] for r in results if r.get("train_seconds") is None and r.get("time") is None]
    if untimed:
        found.append(f"no step times in metrics.jsonl for {', '.join(untimed)}: training time unknown")
    steps_only = [r["run"] for r in results if r.get("time") is None and r.get("train_seconds") is not None]
    if steps_only and len(steps_only) < len(results):
        found.append(f"{', '.join(steps_only)} trained before nanopt recorded time per phase: its device-hours and "
                     "cost count training steps only, not setup, evaluation or checkpoints")
    unpriced = [r["run"] for r in results if r.get("time") is not None and r.get("cost_usd") is None]
    if unpriced:
        found.append(f"no price for {', '.join(unpriced)}: pass --price-per-hour (USD per device-hour: a GPU, or "
                     "the machine of a CPU run)")
    return found


def training_record(trained: TrainedModel) -> dict[str, Any]:
    """What the run cost to get to this checkpoint, as far as the checkpoint and metrics.jsonl tell."""
    meta, run = trained.checkpoint.meta, trained.run
    records = read_metrics(run.run_dir)
    return {"parameters": count_params(run.model).total, "tokens_trained": int(meta.get("tokens", 0)),
            "global_batch_tokens": run.train.global_batch_tokens, "train_world_size": int(meta.get("world_size", 1)),
            # What the device-hours were hours of ("cpu", "cuda"); None for a checkpoint older than the field.
            "train_device_type": meta.get("device_type"),
            "train_seconds": training_seconds(records, trained.checkpoint.step),
            # Each training session's time per phase to this checkpoint: `compare` prices them.
            "train_sessions": newest_per_session(records, trained.checkpoint.step),
            # What was predicted before the first step, against what training measured to this checkpoint.
            "prediction": compared(run.run_dir, trained.checkpoint.step, records)}


def training_seconds(records: list[dict[str, Any]], up_to_step: int) -> float | None:
    """Sum of logged step times up to a step: step_time_s x the steps since the previous log line.

    Start-up, eval and checkpoint pauses are not step time and are left out. A resume restarts the count at the
    checkpoint's step (steps run after the last log line of a killed session were not logged and are missing).
    None when metrics.jsonl has no step times.
    """
    total, previous_step, found = 0.0, 0, False
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or step > up_to_step:
            continue
        if record.get("kind") == "event" and record.get("event") == "resume":
            previous_step = step
        elif record.get("kind") == "train" and isinstance(record.get("step_time_s"), (int, float)):
            total += record["step_time_s"] * max(0, step - previous_step)
            previous_step, found = step, True
    return total if found else None
