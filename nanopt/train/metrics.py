"""What a run records: metrics.jsonl, loss spikes, the loss-curve PNG.

metrics.jsonl is the source of truth: one JSON object per line, `{"kind": "train", ...}` per logged step,
`{"kind": "eval", ...}` per evaluation, `{"kind": "event", ...}` for skipped steps, spikes and resumes, and
`{"kind": "phases", ...}` for the time each session spent per phase (nanopt.train.phases). Every record carries
`time`, the wall clock (Unix seconds) when it was written.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from nanopt.rundir import RunDir


class MetricsLog:
    """Appends records to runs/NAME/metrics.jsonl (rank 0 only), flushed per line so a kill loses nothing."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.path = RunDir(run_dir).metrics
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint: they will be run again. Phase records stay: that
        time was spent (and paid for) whether or not its steps are run again. Writes nothing when there is nothing
        to drop, and leaves the file as it was if the rewrite fails (a full disk)."""
        if not (self.enabled and self.path.is_file()):
            return
        lines = [line for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.strip()]
        kept = [line for line in lines if _record_step(line) <= step or _is_phases(line)]
        if len(kept) == len(lines):
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            tmp.replace(self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def write(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, **fields, "time": round(time.time(), 3)}, allow_nan=True) + "\n")


def _is_phases(line: str) -> bool:
    try:
        return json.loads(line).get("kind") == "phases"
    except (json.JSONDecodeError, AttributeError):
        return False


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, TypeError, ValueError):
        return sys.maxsize  # a torn last line from a kill: drop it


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).metrics
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():  # a torn tail is skipped
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


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


def write_loss_chart(run_dir: Path) -> Path | None:
    """Train and validation loss against tokens, as a PNG beside metrics.jsonl."""
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train", linewidth=1)
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(f"{Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = RunDir(run_dir).chart
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
