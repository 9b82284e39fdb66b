"""Which settings differ between compared runs: every model.json and train.json key whose value is not the same in
all of them, as each checkpoint was trained (its config snapshot, which also holds what `--set` changed on the
command line: a learning rate typed three times too large shows even when train.json was never edited).

A key counts only when it can explain a difference the comparison shows: what the run learned, or what it cost.
The rest would bury the few keys that matter under rows that say nothing about the result, so they are left out
(NOT_COMPARED says why each). The dataset is compared as the directory `data` names, relative to its run (two runs
reading data/x through different relative paths read the same dataset); a mixture as written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nanopt.config.no_data import is_placeholder
from nanopt.parsing import plain_path
from nanopt.untrusted_text import printable

NOT_COMPARED = frozenset({
    # What is logged, reported or kept, and where: none of it touches the weights or the time a step takes.
    "log_interval", "keep_checkpoints", "health", "tensorboard", "wandb_project", "wandb_mode", "on_exit",
    "on_exit_timeout_s", "stall_timeout_s", "data_epochs_warning",
    # What training measures and saves along the way, not what it learns: the time they took is in the comparison's
    # time per phase (evaluation, checkpointing), their results in the runs' metrics.
    "eval_interval", "eval_tokens", "checkpoint_interval", "checkpoint_async", "downstream_tasks",
    "downstream_interval", "downstream_examples", "downstream_task_data",
    # A price, not a setting of the run: the comparison's cost column is priced by --price-per-hour, else by it.
    "price_per_hour",
})
FILES = (("model", "model.json"), ("train", "train.json"))
MAX_SHOWN = 80  # characters of one value in the table; --json has it whole
UNKNOWN = "?"  # the value of a run whose reused eval.json does not carry its config


def differences(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{"setting": "train.json learning_rate", "values": [one per result, in order]}] for every compared key
    whose values are not all equal; [] when none differ. Model keys first, each file in its keys' order."""
    settings = [_compared(r) for r in results]
    known = [s for s in settings if s is not None]
    found = []
    for section, file in FILES:
        keys = list(dict.fromkeys(key for s in known for key in s[section]))
        for key in keys:
            values = [s[section].get(key) for s in known]
            if any(value != values[0] for value in values[1:]):
                shown_values = [UNKNOWN if s is None else s[section].get(key) for s in settings]
                found.append({"setting": f"{file} {key}", "values": shown_values})
    return found


def _compared(result: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """A result's config snapshot, as compared: the keys that count, `seq_len` as trained (null is the model's
    max_position_embeddings) and `data` as the directory it names. None for an eval.json written before results
    carried their config (reused as it is): its values are unknown, not different."""
    config = result.get("config")
    if not isinstance(config, dict):
        return None
    model, train = dict(config.get("model") or {}), dict(config.get("train") or {})
    train = {key: value for key, value in train.items() if key not in NOT_COMPARED}
    if train.get("seq_len") is None and "seq_len" in train:
        train["seq_len"] = model.get("max_position_embeddings")
    if isinstance(train.get("data"), str):
        train["data"] = _dataset(train["data"], Path(result["run"]))
    return {"model": model, "train": train}


def _dataset(data: str, run_dir: Path) -> str:
    if is_placeholder(data):
        return "none yet (nanopt import's placeholder)"
    return str(plain_path(run_dir / data))  # an absolute path stays as it is


def shown(value: Any) -> str:
    """A value as a person reads it in the table: JSON's words (true, null), integers with thousands separators,
    floats exactly (two learning rates that differ never read alike), control characters made visible, and at most
    MAX_SHOWN characters."""
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, sort_keys=True, default=str)
    text = printable(text)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."
