"""Reusing an earlier evaluation when runs are compared (`nanopt eval RUN1 RUN2 ...`): the checkpoint's eval.json,
or a line of the run's eval_history.jsonl, made with exactly this evaluation's settings (the weights' checksum,
the data, the tokens scored, the samples' and tasks' settings).

Such a file may come from someone else with a shared run. So only what a forward pass measured is taken from it,
each value checked (the test loss, per-source losses, samples, task scores, and how and where it was measured);
everything nanopt can work out again is worked out again by the caller (which run and checkpoint, the training's
cost from metrics.jsonl, perplexity and bits per byte from the loss and the dataset). A stored result that fails
a check is not reused: the checkpoint is evaluated again, with a note saying why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.errors import CheckpointError
from nanopt.evaluate.history import read_history, with_settings
from nanopt.parsing import read_json, show_value
from nanopt.rundir import EVAL_FILE
from nanopt.train.checkpoint import Checkpoint
from nanopt.train.checkpoint.meta_fields import is_int, is_number


class NotReusable(ValueError):
    """A stored result that cannot stand for this evaluation; the message says which value and why."""


def previous_result(ckpt: Checkpoint, settings: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's eval.json if it was made with exactly these settings, else the run's newest such result in
    eval_history.jsonl (`eval --watch` writes none into the checkpoint). Unchecked: see `measured`."""
    try:
        previous = read_json(ckpt.path / EVAL_FILE, error=CheckpointError)
    except CheckpointError:  # none yet, or unreadable (never a named pipe's blocking read): look in the history
        previous = None
    if isinstance(previous, dict) and previous.get("settings") == settings:
        return previous
    found = with_settings(read_history(run_dir), ckpt.step, settings)
    return None if found is None else {k: v for k, v in found.items() if k not in ("checkpoint_id", "options")}


def measured(stored: dict[str, Any], tokens: int, sources: list[str]) -> dict[str, Any]:
    """What the stored evaluation measured, checked: NotReusable names the first value that is wrong. `tokens`: the
    targets this evaluation scores, which the stored one must have scored too; `sources`: the names of the
    mixture's sources (none for one dataset), each of which it must have scored."""
    if stored.get("tokens") != tokens:
        raise NotReusable(f"it scored {show_value(stored.get('tokens'))} tokens, this evaluation {tokens:,}")
    part = {"test_loss": _number(stored, "test_loss"), "tokens": tokens,
            "eval_seconds": _number(stored, "eval_seconds"),
            "micro_batch_size": _count(stored, "micro_batch_size", low=1),
            "world_size": _count(stored, "world_size", low=1),
            "device": _text(stored, "device"), "precision": _text(stored, "precision"),
            "tf32": _flag(stored, "tf32"), "created": _text(stored, "created"),
            "samples": [_sample(sample, i) for i, sample in enumerate(_list(stored, "samples"))]}
    stored_sources = {} if stored.get("sources") is None else _mapping(stored, "sources")
    if sorted(stored_sources) != sorted(sources):
        raise NotReusable(f"it scored the sources {show_value(sorted(stored_sources))}, this dataset has "
                          f"{show_value(sorted(sources))}")
    if sources:
        part["sources"] = {name: _source(source, name) for name, source in stored_sources.items()}
    if stored.get("tasks") is not None:
        part["tasks"] = {name: _task(task, f"tasks.{name}", timed=True) for name, task in
                         _mapping(stored, "tasks").items()}
        part["centered_mean"] = _number(stored, "centered_mean", optional=True, signed=True)
    if stored.get("harness") is not None:
        part["harness"] = {name: _task(task, f"harness.{name}", timed=False) for name, task in
                           _mapping(stored, "harness").items()}
        part["harness_seconds"] = _number(stored, "harness_seconds", optional=True)
    return part


def _source(source: Any, name: str) -> dict[str, Any]:
    where = f"sources.{name}"
    return {"test_loss": _number(_object(source, where), "test_loss", where),
            "tokens": _count(source, "tokens", where=where)}


def _sample(sample: Any, index: int) -> dict[str, Any]:
    where = f"samples[{index}]"
    sample = _object(sample, where)
    checked = {"prompt": _text(sample, "prompt", where), "completion": _text(sample, "completion", where),
               "ended": _flag(sample, "ended", where), "new_tokens": _count(sample, "new_tokens", where=where),
               "prompt_tokens": _count(sample, "prompt_tokens", where=where)}
    if sample.get("stopped") is not None:
        checked["stopped"] = _text(sample, "stopped", where)
    return checked


def _task(task: Any, where: str, timed: bool) -> dict[str, Any]:
    """A task's scores, as nanopt.evaluate.tasks and the harness write them: accuracy (and its variants) as
    {value, stderr}, a perplexity, the centered accuracy, the examples scored and, for nanopt's, its kind, chance
    level, source, prompts cut at the context and seconds."""
    task = _object(task, where)
    checked: dict[str, Any] = {"acc": _metric(task, "acc", where)}
    for name in ("acc_norm", "acc_per_token"):
        if name in task:
            checked[name] = _metric(task, name, where)
    if "perplexity" in task:
        checked["perplexity"] = _number(task, "perplexity", where)
    if "centered" in task:
        checked["centered"] = {**_metric(task, "centered", where, signed=True),
                               "of": _text(task["centered"], "of", f"{where}.centered")}
    if task.get("n") is not None:
        checked["n"] = _count(task, "n", where=where)
    for key in ("kind", "source"):  # nanopt's own: the task's kind and where its examples came from
        if key in task:
            checked[key] = _text(task, key, where)
    if "chance" in task:
        checked["chance"] = _number(task, "chance", where)
    if "truncated" in task:
        checked["truncated"] = _count(task, "truncated", where=where)
    if timed:
        checked["seconds"] = _number(task, "seconds", where)
    return checked


def _metric(task: dict[str, Any], name: str, where: str, signed: bool = False) -> dict[str, Any]:
    metric = _object(task.get(name), f"{where}.{name}")
    return {"value": _number(metric, "value", f"{where}.{name}", signed=signed),
            "stderr": _number(metric, "stderr", f"{where}.{name}", optional=True)}


# ---------------------------------------------------------------------------------------------------- values


def _say(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _number(record: dict[str, Any], key: str, where: str = "", optional: bool = False,
            signed: bool = False) -> float | None:
    """A finite number (at least 0 unless `signed`): losses, seconds, scores."""
    value = record.get(key)
    if value is None and optional:
        return None
    if not is_number(value) or (value < 0 and not signed):
        raise NotReusable(f"{_say(where, key)} is {show_value(value)}, not a finite number"
                          + ("" if signed else " >= 0"))
    return float(value)


def _count(record: Any, key: str, low: int = 0, where: str = "") -> int:
    value = record.get(key) if isinstance(record, dict) else None
    if not is_int(value, low):
        raise NotReusable(f"{_say(where, key)} is {show_value(value)}, not a whole number >= {low}")
    return value


def _text(record: Any, key: str, where: str = "") -> str:
    value = record.get(key) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise NotReusable(f"{_say(where, key)} is {show_value(value)}, not a string")
    return value


def _flag(record: dict[str, Any], key: str, where: str = "") -> bool:
    value = record.get(key)
    if not isinstance(value, bool):
        raise NotReusable(f"{_say(where, key)} is {show_value(value)}, not true or false")
    return value


def _list(record: dict[str, Any], key: str) -> list[Any]:
    value = record.get(key)
    if not isinstance(value, list):
        raise NotReusable(f"{key} is {show_value(value)}, not a list")
    return value


def _mapping(record: dict[str, Any], key: str) -> dict[str, Any]:
    return _object(record.get(key), key)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NotReusable(f"{where} is {show_value(value)}, not an object")
    return value
