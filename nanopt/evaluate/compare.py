"""Comparing evaluated runs: best test loss first, with what each run took to train (time per phase) and its cost.

Test loss compares runs only when they were evaluated on the same test tokens; bits per byte also compares runs
with different tokenizers (on the same text). `notes` says when a comparison needs that caveat.
"""

from __future__ import annotations

import math
from typing import Any

from nanopt.train.phases import run_time


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
