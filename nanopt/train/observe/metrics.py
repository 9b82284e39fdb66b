"""What a run records: metrics.jsonl, loss spikes, the loss-curve PNG.

metrics.jsonl is the source of truth: one JSON object per line, `{"kind": "train", ...}` per logged step,
`{"kind": "eval", ...}` per evaluation, `{"kind": "event", ...}` for skipped steps, spikes, resumes and the like, and
`{"kind": "phases", ...}` for the time each session spent per phase (nanopt.train.observe.phases). Every record carries
`time`, the wall clock (Unix seconds) when it was written. Read back through nanopt.train.observe.records, which skips
any line that is not a record of the types written here.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanopt.errors import NanoptError
from nanopt.files import append_whole, replacing
from nanopt.parsing import INT64_MAX
from nanopt.rundir import RunDir
from nanopt.train.observe.eval_history import loss_by_tokens, read_history
from nanopt.train.observe.records import iter_records, metrics_lines, parse_record, read_records
from nanopt.train.observe.task_curves import draw_task_accuracy

if TYPE_CHECKING:
    from nanopt.train.observe.sinks import Sinks


class MetricsLog:
    """Appends records to runs/NAME/metrics.jsonl (rank 0 only), flushed per line so a kill loses nothing, and hands
    each record, as written, to the session's sinks (TensorBoard, W&B: nanopt.train.observe.sinks)."""

    def __init__(self, run_dir: Path, enabled: bool, sinks: Sinks | None = None) -> None:
        self.path = RunDir(run_dir).metrics
        self.enabled = enabled
        self.sinks = sinks

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint: they will be run again. Phase and recovery records
        stay: that time was spent (and paid for), and the recovery made, whether or not its steps are run again.
        Writes nothing when there is nothing to drop, and leaves the file as it was if the rewrite fails (a full
        disk). Two passes, a line at a time: memory bounded by a line, whatever the file's length."""
        if not (self.enabled and os.path.lexists(self.path)):
            return
        if self.sinks is not None:
            self.sinks.restart_after(step)
        if all(_kept_line(line, step) for line in metrics_lines(self.path)):
            return
        with replacing(self.path) as f:
            for line in metrics_lines(self.path):
                if line is not None and line.strip() and _kept_line(line, step):
                    f.write((line + "\n").encode("utf-8"))

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, **fields, "time": round(time.time(), 3)}
        append_whole(self.path, json.dumps(record, allow_nan=True) + "\n")
        if self.sinks is not None:  # after metrics.jsonl has it: a sink never costs the source of truth a record
            self.sinks.write(record)

    def close(self) -> None:
        """Flush and close the sinks: at the end of the session."""
        if self.sinks is not None:
            self.sinks.close()


def _kept_line(line: str | None, step: int) -> bool:
    """Whether a resume to `step` keeps a line of metrics.jsonl (a blank line is neither kept nor dropped: the
    rewrite leaves it out)."""
    if line is not None and not line.strip():
        return True
    return _kept(parse_record(line) if line is not None else None, step)


def _kept(record: dict[str, Any] | None, step: int) -> bool:
    """Whether a resume to `step` keeps a record: one of a step up to it (a record without a step: kept), and
    those a resume or a rollback never drops: time spent (phases) and recoveries made, which happened whether or
    not their steps are run again. A line that is not a record (torn by a kill) is dropped."""
    if record is None:
        return False
    return record.get("step", 0) <= step or record.get("kind") == "phases" or record.get("event") == "recovery"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of runs/NAME/metrics.jsonl that nanopt can use (nanopt.train.observe.records), in the order written,
    all in memory (several times the file's size: iter_metrics reads it in bounded memory)."""
    return read_records(RunDir(run_dir).metrics)


def iter_metrics(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The records of read_metrics, one at a time: memory bounded by one line (nanopt.train.observe.records)."""
    return iter_records(RunDir(run_dir).metrics)


class SpikeMonitor:
    """Flags a loss more than `threshold` standard deviations above the rolling mean of the last `window`."""

    def __init__(self, threshold: float, window: int = 50, min_history: int = 20) -> None:
        self.threshold = threshold
        self.history: deque[float] = deque(maxlen=window)
        self.min_history = min_history

    def check(self, loss: float) -> float | None:
        """The z-score of a spike, or None."""
        spike = None
        if len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            z = (loss - mean) / max(std, 1e-6)
            if z > self.threshold:
                spike = z
        if math.isfinite(loss):
            self.history.append(loss)
        return spike


CHART_BUCKETS = 2000  # per curve: a chart 900 pixels wide shows no more, and each run keeps its lowest and highest


class Thinned:
    """A curve's (x, y) points thinned as they are read, in memory bounded by `buckets`: runs of consecutive
    points, each kept as its lowest and its highest point (so a spike survives the thinning, and the extremes a
    chart shows are the curve's own). When the buckets fill, neighbours merge and runs double in length: a
    constant time per point. Non-finite values are left out (a chart cannot place them)."""

    def __init__(self, buckets: int = CHART_BUCKETS) -> None:
        self.buckets = buckets
        self.run_length = 1
        self.count = 0
        self.kept: list[list[Any]] = []  # per run: [lowest (index, x, y), highest (index, x, y), points]

    def add(self, x: float, y: Any) -> None:
        if not (isinstance(y, float) or type(y) is int and abs(y) <= INT64_MAX) or not math.isfinite(y):
            return  # an int past a float (a stranger's file) would make math.isfinite raise
        point, self.count = (self.count, x, y), self.count + 1
        last = self.kept[-1] if self.kept else None
        if last is None or last[2] >= self.run_length:
            self.kept.append([point, point, 1])
            if len(self.kept) > self.buckets:
                self._merge()
            return
        last[0] = point if y < last[0][2] else last[0]
        last[1] = point if y > last[1][2] else last[1]
        last[2] += 1

    def _merge(self) -> None:
        pairs = [(self.kept[i], self.kept[i + 1]) for i in range(0, len(self.kept) - 1, 2)]
        merged = [[min(a[0], b[0], key=lambda p: p[2]), max(a[1], b[1], key=lambda p: p[2]), a[2] + b[2]]
                  for a, b in pairs]
        self.kept = merged + ([self.kept[-1]] if len(self.kept) % 2 else [])
        self.run_length *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The kept points in the order they came: each run's lowest and highest."""
        chosen = sorted({p for low, high, _ in self.kept for p in (low, high)})
        return [x for _, x, _ in chosen], [y for _, _, y in chosen]


# Events marked on the loss chart, each with its own line style: (label, color, line style).
CHART_EVENTS = {"recovery": ("recovery (rolled back)", "tab:red", "--"),
                "loss_spike": ("loss spike", "tab:orange", ":"),
                "data_phase": ("data phase begins", "tab:green", "-.")}
# Events whose step is the first of what they mark: drawn where that step begins, not where it ends.
STARTS_AT_STEP = {"data_phase"}
# Written into every PNG nanopt draws, so that a chart may be replaced and any other file never is.
CHART_SOFTWARE = "nanopt"


Curve = tuple[list[int], list[float]]  # tokens, loss


def _times(count: int) -> str:
    """How often an event happened, as a legend says it: "(1)" read like "phase 1" beside a data phase's line."""
    return "once" if count == 1 else f"{count} times"


def loss_curves(records: list[dict[str, Any]]) -> tuple[Curve, Curve]:
    """Train loss and validation loss against tokens, from the train and eval records in the order written."""
    train = [r for r in records if r.get("kind") == "train" and "tokens" in r and "loss" in r]
    val = [r for r in records if r.get("kind") == "eval" and "tokens" in r and "val_loss" in r]
    return ([r["tokens"] for r in train], [r["loss"] for r in train]), ([r["tokens"] for r in val],
                                                                          [r["val_loss"] for r in val])


def event_marks(records: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The tokens at which each charted event happened (a `recovery` at the step where it was decided, a data phase
    where its first step begins), from the tokens per step of the train records (the global batch never changes
    within a run)."""
    train = [r for r in records if r.get("kind") == "train" and r.get("step") and "tokens" in r]
    if not train:
        return {}
    tokens_per_step = train[-1]["tokens"] / train[-1]["step"]
    marks: dict[str, list[int]] = {}
    for r in records:
        if r.get("kind") == "event" and r.get("event") in CHART_EVENTS and r.get("step") is not None:
            steps = r["step"] - (1 if r["event"] in STARTS_AT_STEP else 0)
            marks.setdefault(r["event"], []).append(round(steps * tokens_per_step))
    return marks


def loss_chart(run_dir: Path) -> Any:
    """The loss chart's matplotlib Figure (train and validation loss against tokens, the checkpoints' test loss as
    crosses, recoveries, loss spikes and data phases as vertical lines), or None before the first train record, to save
    (save_chart) or inspect."""
    records = read_metrics(run_dir)
    train, val = loss_curves(records)
    if not train[0]:
        return None
    fig = new_figure(figsize=(8, 4.5), dpi=110)
    ax = fig.subplots()
    ax.plot(*train, label="train", linewidth=1)
    if val[0]:
        ax.plot(*val, "o-", label="val")
    tested = _test_losses(run_dir)
    if tested[0]:
        ax.plot(*tested, "x", markersize=7, markeredgewidth=2, label="test (nanopt eval)")
    draw_task_accuracy(ax, records)  # downstream tasks (train.json downstream_tasks), on a right-hand axis
    for event, tokens in event_marks(records).items():
        label, color, style = CHART_EVENTS[event]
        for i, x in enumerate(tokens):  # one legend entry per kind of event
            ax.axvline(x, color=color, linestyle=style, linewidth=1,
                       label=f"{label}: {_times(len(tokens))}" if i == 0 else None)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _test_losses(run_dir: Path) -> Curve:
    """Each evaluated checkpoint's test loss (eval_history.jsonl: `nanopt eval`, `eval --watch` beside the run); none
    when that file cannot be read: a chart never stops a training."""
    try:
        return loss_by_tokens(read_history(run_dir))
    except (NanoptError, OSError):
        return [], []


def new_figure(**options: Any) -> Any:
    """A matplotlib Figure of nanopt's charts, outside pyplot: pyplot would switch the process's backend (a
    notebook's, when one calls these functions) and keep every figure until closed, a figure left behind by a chart
    that failed midway included. This one is freed with its last reference and drawn by its own Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**options)
    FigureCanvasAgg(figure)  # attaches itself: figure.canvas
    return figure


def save_chart(fig: Any, path: Path) -> Path:
    """Save a figure as a PNG atomically (a kill never leaves half an image), marked as nanopt's."""
    with replacing(path) as f:  # a file object: matplotlib never opens a path, which could be a link
        fig.savefig(f, format="png", metadata={"Software": CHART_SOFTWARE})
    return path


def write_loss_chart(run_dir: Path) -> Path | None:
    """Train and validation loss against tokens, with events marked, as a PNG beside metrics.jsonl."""
    fig = loss_chart(run_dir)
    return None if fig is None else save_chart(fig, RunDir(run_dir).chart)
