"""The run's evaluation history: RUN/eval_history.jsonl, one test-loss result a line, appended by every `nanopt eval
RUN` and by `nanopt eval RUN --watch` for each checkpoint it scores.

A line is the eval.json object of that evaluation plus two keys: `checkpoint_id` (the sha256 of the checkpoint's
file checksums, as its meta.json lists them: the exact files scored) and `options` (the evaluation options that
decide its numbers: --data, --tokens, the samples' settings, --tasks, --harness).

Readers: the watcher (a checkpoint the history holds a result for, with the same files and options, is not scored
again: a restarted watcher goes on where it stopped), the reuse of results when several runs are compared
(report.previous_result), and the comparison chart (each run's test loss against tokens trained). The file is
appended whole or not at all, never through a link (nanopt.files.append_whole); a reader skips any line that is
not such a result (torn by a kill, or from elsewhere), as metrics.jsonl's readers do.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError, NanoptError
from nanopt.files import append_whole
from nanopt.parsing import open_regular, parse_json_text
from nanopt.rundir import RunDir

MAX_LINE_BYTES = 1 << 22  # a result with samples and tasks is a few KiB; past this a line is not one of ours
_HINT = "eval_history.jsonl is the log `nanopt eval` appends to: move the file aside"


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


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The results in RUN/eval_history.jsonl, in the order written: lines that are no result are skipped. Nothing
    when there is no file; ConfigError, one line, when it is not a regular file (a named pipe would block)."""
    path = RunDir(run_dir).eval_history
    if not os.path.lexists(path):
        return []
    records = []
    with open_regular(path, ConfigError, _HINT, "evaluation history") as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # the rest of the long line, a piece at a time
                    line = f.readline(MAX_LINE_BYTES + 1)
                continue
            record = _parse(line.decode("utf-8", errors="replace"))
            if record is not None:
                records.append(record)
    return records


def _parse(line: str) -> dict[str, Any] | None:
    try:
        record = parse_json_text(line, "eval_history.jsonl")
    except NanoptError:
        return None
    if not isinstance(record, dict):
        return None
    step, tokens, loss = record.get("step"), record.get("tokens_trained"), record.get("test_loss")
    counts = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, tokens))
    if not counts or not isinstance(loss, (int, float)) or isinstance(loss, bool):
        return None
    if not isinstance(record.get("settings"), dict):
        return None
    return record


def scored(records: list[dict[str, Any]], step: int, meta: dict[str, Any], opts: Any) -> bool:
    """Whether the history holds a result for this checkpoint (its step and files) under these options."""
    ident, key = checkpoint_id(meta), options_key(opts)
    return any(r["step"] == step and r.get("checkpoint_id") == ident and r.get("options") == key for r in records)


def with_settings(records: list[dict[str, Any]], step: int, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The newest result for checkpoint step `step` evaluated with exactly `settings` (eval.json's reuse key, which
    names the weights' checksum), or None."""
    found = [r for r in records if r["step"] == step and r["settings"] == settings]
    return found[-1] if found else None


def loss_by_tokens(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """Test loss against tokens trained, one point per checkpoint (its newest finite result), in token order."""
    newest: dict[int, float] = {}
    for r in records:
        if math.isfinite(r["test_loss"]):
            newest[r["tokens_trained"]] = float(r["test_loss"])
    tokens = sorted(newest)
    return tokens, [newest[t] for t in tokens]
