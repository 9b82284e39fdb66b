"""RUN/eval_history.jsonl read back: the run's test-loss results that nanopt's readers can use (the format and the
writer: nanopt.evaluate.history). Here, below evaluate, so the run's own loss chart (nanopt.train.observe.metrics) can
draw the test loss that `nanopt eval --watch` measures beside the training.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError, NanoptError
from nanopt.parsing import open_regular, parse_json_text
from nanopt.rundir import RunDir

MAX_LINE_BYTES = 1 << 22  # a result with samples and tasks is a few KiB; past this a line is not one of ours
_HINT = "eval_history.jsonl is the log `nanopt eval` appends to: move the file aside"


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The results in RUN/eval_history.jsonl, in the order written: lines that are no result are skipped. Nothing
    when there is no file; ConfigError, one line, when it is not a regular file (a named pipe would block)."""
    path = RunDir(run_dir).eval_history
    if not os.path.lexists(path):
        return []
    records = []
    with open_regular(path, ConfigError, _HINT, "results log") as f:
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


def loss_by_tokens(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """Test loss against tokens trained, one point per checkpoint (its newest finite result), in token order."""
    newest: dict[int, float] = {}
    for r in records:
        if math.isfinite(r["test_loss"]):
            newest[r["tokens_trained"]] = float(r["test_loss"])
    tokens = sorted(newest)
    return tokens, [newest[t] for t in tokens]
