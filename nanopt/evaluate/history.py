"""The run's evaluation history: RUN/eval_history.jsonl, one test-loss result a line, appended by every `nanopt eval
RUN` and by `nanopt eval RUN --watch` for each checkpoint it scores.

A line is the eval.json object of that evaluation plus two keys: `checkpoint_id` (the sha256 of the checkpoint's
file checksums, as its meta.json lists them: the exact files scored) and `options` (the evaluation options that
decide its numbers: --data, --tokens, the samples' settings, --tasks, --harness).

Readers: the watcher (a checkpoint the history holds a result for, with the same files and options, is not scored
again: a restarted watcher goes on where it stopped), the reuse of results when several runs are compared
(reuse.previous_result), the comparison chart and the run's own loss.png (each run's test loss against tokens
trained; read by nanopt.train.observe.eval_history, a layer below, for the latter). The file is
appended whole or not at all, never through a link (nanopt.files.append_whole); a reader skips any line that is
not such a result (torn by a kill, or from elsewhere), as metrics.jsonl's readers do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nanopt.files import append_whole
from nanopt.rundir import RunDir
from nanopt.train.observe.eval_history import loss_by_tokens, read_history

__all__ = ["append_result", "checkpoint_id", "loss_by_tokens", "options_key", "read_history", "scored",
           "with_settings"]


def checkpoint_id(meta: dict[str, Any]) -> str:
    """Which exact files a checkpoint holds: the sha256 of its meta.json's file checksums."""
    files = meta.get("files") if isinstance(meta, dict) else None
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def options_key(opts: Any) -> dict[str, Any]:
    """Of report.EvalOptions (not imported: report imports this module), the options that decide an evaluation's
    numbers, as they read back from the history (JSON types)."""
    tasks = opts.tasks
    key = {"data": None if opts.data is None else str(opts.data), "tokens": opts.tokens,
           "samples": asdict(opts.samples) if opts.samples else None,
           "tasks": None if tasks is None else {**asdict(tasks), "task_data": None if tasks.task_data is None
                                                else str(tasks.task_data)},
           "harness": None if opts.harness is None else opts.harness.settings()}
    return json.loads(json.dumps(key))


def append_result(run_dir: Path, result: dict[str, Any], meta: dict[str, Any], opts: Any) -> None:
    """One line for `result` (the checkpoint's meta.json gives its id), appended to RUN/eval_history.jsonl."""
    record = {**result, "checkpoint_id": checkpoint_id(meta), "options": options_key(opts)}
    append_whole(RunDir(run_dir).eval_history, json.dumps(record) + "\n")


def scored(records: list[dict[str, Any]], step: int, meta: dict[str, Any], opts: Any) -> bool:
    """Whether the history holds a result for this checkpoint (its step and files) under these options."""
    ident, key = checkpoint_id(meta), options_key(opts)
    return any(r["step"] == step and r.get("checkpoint_id") == ident and r.get("options") == key for r in records)


def with_settings(records: list[dict[str, Any]], step: int, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The newest result for checkpoint step `step` evaluated with exactly `settings` (eval.json's reuse key, which
    names the weights' checksum), or None."""
    found = [r for r in records if r["step"] == step and r["settings"] == settings]
    return found[-1] if found else None
