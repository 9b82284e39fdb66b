"""metrics.jsonl read back: the records every reader may rely on, and the lines none of them can.

Readers: a resume (MetricsLog.truncate_after drops the steps it will run again; the spike monitor's history; the
phases of earlier sessions; the data_repeats event), `nanopt eval` (training time and cost to the checkpoint) and
the loss charts of train and eval. A run directory may come from someone else, and a line of metrics.jsonl may
be torn by a kill, so a record is handed to them only if it is a JSON object and each field of FIELDS it has holds
the type nanopt writes there (a reader still checks that a field it needs is present). Any other line is skipped,
as a torn last line always was (and dropped from the file when a resume rewrites it): the file is a log, and one
bad line must cost neither a resume nor an evaluation. A line longer than MAX_LINE_BYTES is skipped without being
read into memory whole (nanopt's records are a few hundred bytes). metrics.jsonl itself must be a regular file
(nanopt.parsing.open_regular: a named pipe would block), else a ConfigError, one line.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError, NanoptError
from nanopt.parsing import INT64_MAX, open_regular, parse_json_text

MAX_LINE_BYTES = 1 << 20
_HINT = "metrics.jsonl is the log `nanopt train` writes: move the file aside, or start a new run directory"


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT64_MAX


def _number(value: Any) -> bool:
    """A float (a loss may be NaN or infinite: that is what was measured) or an int64."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= INT64_MAX
    return isinstance(value, float)


def _duration(value: Any) -> bool:
    return _number(value) and math.isfinite(value) and value >= 0


# The fields nanopt's readers use, each with the test its value must pass where it is present.
FIELDS: dict[str, Callable[[Any], bool]] = {
    "kind": lambda v: isinstance(v, str), "event": lambda v: isinstance(v, str),
    "step": _count, "tokens": _count, "run_tokens": _count, "world_size": lambda v: _count(v) and v >= 1,
    "loss": _number, "val_loss": _number, "step_time_s": _duration, "wall_s": _duration,
    "session_start": lambda v: _number(v) and math.isfinite(v), "price_per_hour": lambda v: v is None or _duration(v),
    "seconds": lambda v: isinstance(v, dict) and all(_duration(s) for s in v.values()),
}


def parse_record(line: str) -> dict[str, Any] | None:
    """The record on one line of metrics.jsonl, or None when it is not one nanopt's readers can use."""
    try:
        record = parse_json_text(line, "metrics.jsonl")
    except NanoptError:  # malformed, torn, too deep, a number past Python's int limit
        return None
    if not isinstance(record, dict) or not all(test(record[key]) for key, test in FIELDS.items() if key in record):
        return None
    return record


def metrics_lines(path: Path) -> Iterator[str | None]:
    """The lines of metrics.jsonl, without their newline; None for one longer than MAX_LINE_BYTES (not kept in
    memory). Nothing when there is no file; ConfigError, one line, when it is not a regular file."""
    if not os.path.lexists(path):
        return
    with open_regular(path, ConfigError, _HINT, "metrics log") as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):  # the rest of the long line, a piece at a time
                    line = f.readline(MAX_LINE_BYTES + 1)
                yield None
            else:
                yield line.decode("utf-8", errors="replace").rstrip("\r\n")


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """The usable records of metrics.jsonl, one at a time, in the order written (see the module docstring for what
    is skipped): a reader that keeps only what it needs runs in memory bounded by MAX_LINE_BYTES, whatever the
    file's length."""
    for line in metrics_lines(path):
        if line is not None and (record := parse_record(line)) is not None:
            yield record


def read_records(path: Path) -> list[dict[str, Any]]:
    """The usable records of metrics.jsonl, in the order written, all in memory: as much as the file, and more
    (a train record of ~800 bytes takes ~4 KB as Python objects). A reader of a file that grows with the run
    (millions of lines on a long run) uses iter_records."""
    return list(iter_records(path))
