"""Comparing evaluated runs: best test loss first, with what each run took to train and, given a price, cost.

Test loss compares runs only when they were evaluated on the same test tokens; bits per byte also compares runs
with different tokenizers (on the same text). `notes` says when a comparison needs that caveat.
"""

from __future__ import annotations

import math
from typing import Any

from nanopt.parsing import check_option
from nanopt.plan.estimate import MAX_PRICE_PER_HOUR


def check_price_per_hour(price_per_hour: float | None) -> None:
    """ConfigError unless the price (None: not given) is a finite number of USD from 0 to estimate's bound."""
    check_option("--price-per-hour", price_per_hour, 0, MAX_PRICE_PER_HOUR, "USD per GPU-hour, e.g. 2.99")


def ranked(results: list[dict[str, Any]], price_per_hour: float | None = None) -> list[dict[str, Any]]:
    """Results sorted by test loss (a non-finite loss last), each with device-hours and, given a price, cost."""
    rows = [{**result, **training_cost(result, price_per_hour)} for result in results]
    return sorted(rows, key=lambda row: (not math.isfinite(row["test_loss"]), row["test_loss"]))


def training_cost(result: dict[str, Any], price_per_hour: float | None) -> dict[str, Any]:
    """Device-hours = training time x the number of ranks it trained on; cost = device-hours x price."""
    seconds = result.get("train_seconds")
    if seconds is None:
        return {"gpu_hours": None, "cost_usd": None}
    gpu_hours = seconds / 3600 * result.get("train_world_size", 1)
    return {"gpu_hours": gpu_hours, "cost_usd": gpu_hours * price_per_hour if price_per_hour is not None else None}


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
    untimed = [r["run"] for r in results if r.get("train_seconds") is None]
    if untimed:
        found.append(f"no step times in metrics.jsonl for {', '.join(untimed)}: training time unknown")
    return found
