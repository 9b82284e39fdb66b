"""A run's prediction (RUN/prediction.json, written before its first step by nanopt.plan.prediction) against what
its metrics.jsonl measured: tokens/s, step time, peak memory per GPU, the training steps' time, the whole run's
time and its cost, each with measured / predicted. Shown at the end of every training session and by
`nanopt eval RUN`.

Measured, over every session so far: tokens/s and step time are the medians of the logged windows (a window's
own rate, pauses excluded: the first one's torch.compile or a slow evaluation does not move a median); peak memory
is the largest any log step saw; the steps' time, the whole run's wall time and its cost come from the phases
records (nanopt.train.observe.phases). Until the run is complete, its totals are what it took so far and have no ratio:
the steps still to run would make any ratio of them wrong.

prediction.json may come from someone else, as the whole run directory may: a field that is missing or not a
finite number is shown as unknown, and a file that is not a JSON object of version 1 is no prediction.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from nanopt.errors import NanoptError
from nanopt.parsing import read_json
from nanopt.rundir import RunDir
from nanopt.train.observe.metrics import read_metrics
from nanopt.train.observe.phases import run_time

FORMAT_VERSION = 1
MAX_TEXT = 80
# (key, what it is, unit, whether it is a total of the whole run), in the order shown.
ROWS = (("tokens_per_s", "throughput", "tokens/s", False), ("step_s", "step time", "s", False),
        ("peak_memory_bytes", "peak memory per device", "bytes", False),
        ("train_s", "training steps' time", "s", True), ("total_s", "whole run's time", "s", True),
        ("cost_usd", "cost", "usd", True))


def read_prediction(run_dir: Path) -> dict[str, Any] | None:
    """The run's prediction.json as made, or None when there is none or it is not one nanopt wrote."""
    path = RunDir(run_dir).prediction_json
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except NanoptError:
        return None
    return data if isinstance(data, dict) and data.get("version") == FORMAT_VERSION else None


def measured(records: list[dict[str, Any]], up_to_step: int | None = None) -> dict[str, Any]:
    """What the run measured, to `up_to_step` when given (see the module docstring)."""
    steps = [r for r in records if r.get("kind") == "train" and (up_to_step is None or r.get("step", 0) <= up_to_step)]
    time = run_time(records, up_to_step)
    phases = time.to_dict() if time is not None else None
    return {"steps": max((r.get("step", 0) for r in steps), default=0),
            "tokens_per_s": _median(r.get("tokens_per_s") for r in steps),
            "step_s": _median(r.get("step_time_s") for r in steps),
            "peak_memory_bytes": max((r["peak_memory_bytes"] for r in steps
                                      if _finite(r.get("peak_memory_bytes"))), default=None),
            "train_s": phases["phases"]["train"]["seconds"] if phases else None,
            "total_s": phases["wall_seconds"] if phases else None,
            "cost_usd": phases["cost_usd"] if phases else None}


def compared(run_dir: Path, up_to_step: int | None = None,
             records: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Predicted against measured (from `records`, else the run's metrics.jsonl), row by row; None when the run
    has no prediction."""
    prediction = read_prediction(run_dir)
    if prediction is None:
        return None
    found = measured(read_metrics(run_dir) if records is None else records, up_to_step)
    total_steps = prediction.get("steps")
    complete = _finite(total_steps) and found["steps"] >= total_steps
    seconds = prediction.get("seconds") if isinstance(prediction.get("seconds"), dict) else {}
    predicted = {**prediction, "train_s": seconds.get("train")}
    rows = []
    for key, label, unit, is_total in ROWS:
        want, got = _number(predicted.get(key)), found[key]
        ratio = got / want if want and got is not None and (complete or not is_total) else None
        rows.append({"key": key, "label": label, "unit": unit, "predicted": want, "measured": got,
                     "ratio": ratio, "so_far": is_total and not complete})
    device = prediction.get("device") if isinstance(prediction.get("device"), dict) else {}
    throughput = prediction.get("throughput") if isinstance(prediction.get("throughput"), dict) else {}
    return {"made_by": _text(prediction.get("made_by")), "time": _text(prediction.get("time")),
            "device": _text(device.get("name")), "num_gpus": device.get("num_gpus"),
            "throughput_source": _text(throughput.get("source")),
            "steps": found["steps"], "total_steps": total_steps if _finite(total_steps) else None,
            "complete": bool(complete), "rows": rows}


def _text(value: Any) -> str:
    """A name from the file, as shown: a stranger's 60 MB string is not a title."""
    return "?" if value is None else str(value)[:MAX_TEXT]


def _median(values: Any) -> float | None:
    kept = [float(v) for v in values if _finite(v)]
    return statistics.median(kept) if kept else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value: Any) -> float | None:
    return float(value) if _finite(value) and value > 0 else None
