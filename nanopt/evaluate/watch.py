"""`nanopt eval RUN --watch`: score every checkpoint of a run as training writes it, in a process of its own.

The watcher polls RUN/checkpoints/ every `poll_s` seconds and scores each complete checkpoint it has not scored, in
step order, exactly as `nanopt eval RUN --checkpoint step-N` would (test loss, bits per byte, samples, --tasks),
on its own device (--device: another GPU, or the CPU). It never slows or blocks the trainer: it takes no lock
(RUN/.lock is training's), reads the checkpoint's files as any evaluation does, and writes nothing into
checkpoints/: while it scores a checkpoint it holds it (nanopt.train.checkpoint.hold, a file in RUN/holds/), so
retention keeps it until the hold ends, and the result goes to RUN/eval.json and RUN/eval_history.jsonl only.

Restarted, it goes on where it stopped: a checkpoint that eval_history.jsonl holds a result for, with the same files
and options, is not scored again (nanopt.evaluate.history). It ends when the run is complete (the checkpoint
`latest` names is at the run's last step, and has been scored), or on Ctrl-C / SIGTERM, releasing its hold.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nanopt.errors import CheckpointError, ConfigError
from nanopt.evaluate.history import checkpoint_id, read_history, scored
from nanopt.evaluate.report import EvalOptions, Progress, evaluate_run
from nanopt.evaluate.trained import check_run_directory, run_config_from_snapshot
from nanopt.files import check_run_dir
from nanopt.runtime import init_runtime, runtime_on, shutdown
from nanopt.train.checkpoint import Checkpoint, checkpoints_dir, complete_checkpoints, read_meta, read_pointer, step_of
from nanopt.train.checkpoint.hold import Hold, remove_stale_holds, still_there
from nanopt.train.observe.metrics import iter_metrics

DEFAULT_POLL_S = 30.0
MAX_POLL_S = 86400.0


class WatchEvents:
    """What the watcher tells the CLI as it goes (rank 0 only: the watcher is one process)."""

    def started(self, device: str) -> None:
        """The options, the run and the device are checked: watching begins."""

    def scored(self, result: dict[str, Any]) -> None:
        pass

    def skipped(self, name: str) -> None:
        """Scored before (eval_history.jsonl): a restarted watcher passing over its earlier work."""

    def passed_over(self, name: str, why: str) -> None:
        """Not scored: damaged, or deleted before it could be held."""


@dataclass
class WatchSummary:
    run: str
    scored: list[int] = field(default_factory=list)  # steps scored by this watcher, in order
    skipped: list[int] = field(default_factory=list)  # steps the history already held
    passed_over: dict[str, str] = field(default_factory=dict)  # checkpoint name: why it was not scored
    ended: str = "interrupted"  # "completed": the run's last checkpoint is scored; "interrupted": Ctrl-C / SIGTERM


def check_poll(poll_s: float) -> None:
    if not 0.01 <= poll_s <= MAX_POLL_S:  # NaN fails too
        raise ConfigError(f"--poll {poll_s}: seconds between looks at checkpoints/, from 0.01 to {MAX_POLL_S:,.0f}",
                          "e.g. --poll 30")


def watch_run(run_dir: Path, opts: EvalOptions, *, poll_s: float = DEFAULT_POLL_S, device: str | None = None,
              events: WatchEvents | None = None, progress: Progress | None = None) -> WatchSummary:
    """Score each new checkpoint of `run_dir` until the run is complete or the process is interrupted."""
    run_dir, events = Path(run_dir), events or WatchEvents()
    check_poll(poll_s)
    if not opts.loss:
        raise ConfigError("--watch records each checkpoint's test loss in eval_history.jsonl: it needs the loss",
                          "drop --no-loss")
    check_run_directory(run_dir)
    check_run_dir(run_dir)  # a link at holds/, eval.json or eval_history.jsonl: refused before anything is written
    opts = replace(opts, reuse=False, beside_checkpoint=False)
    summary = WatchSummary(run=str(run_dir))
    rt = init_runtime("auto") if device is None else runtime_on(device)
    remove_stale_holds(run_dir)  # those of a watcher killed earlier
    seen: set[tuple[str, str]] = set()  # (name, checkpoint id) scored, skipped or passed over by this watcher
    try:
        with _stop_signals_interrupt():  # before "watching" is said: from then on Ctrl-C stops it
            # Also before it is said (a training started on that line may save at once), and down to the ms that
            # metrics.jsonl rounds its times to: a checkpoint event recorded after it never compares as before it.
            started = math.floor(time.time() * 1000) / 1000
            events.started(str(rt.device))
            while True:
                history = read_history(run_dir)
                for path in complete_checkpoints(run_dir):
                    _consider(rt, run_dir, path, opts, history, seen, summary, events, progress or Progress())
                _say_missed(run_dir, started, seen, summary, events)
                if _run_complete(run_dir, seen):
                    summary.ended = "completed"
                    return summary
                time.sleep(poll_s)
    except KeyboardInterrupt:
        return summary
    finally:
        shutdown(rt)


def _consider(rt: Any, run_dir: Path, path: Path, opts: EvalOptions, history: list[dict[str, Any]],
              seen: set[tuple[str, str]], summary: WatchSummary, events: WatchEvents, progress: Progress) -> None:
    """Score the checkpoint at `path` unless this watcher or the history has seen it already."""
    meta = _meta(path)
    if meta is None:
        return  # deleted by retention meanwhile, or not a checkpoint: complete_checkpoints lists it no more
    key = (path.name, checkpoint_id(meta))
    if key in seen:
        return
    seen.add(key)
    step = step_of(path)
    if scored(history, step, meta, opts):
        summary.skipped.append(step)
        events.skipped(path.name)
        return
    try:
        result = score(rt, run_dir, path, opts, progress)
    except CheckpointError as exc:  # damaged, or removed while it was read: the next one is scored all the same
        summary.passed_over[path.name] = exc.message
        events.passed_over(path.name, exc.message)
        return
    if result is None:
        why = "deleted by the training's retention before the watcher could hold it"
        summary.passed_over[path.name] = why
        events.passed_over(path.name, why)
        return
    summary.scored.append(step)
    events.scored(result)


def _say_missed(run_dir: Path, since: float, seen: set[tuple[str, str]], summary: WatchSummary,
                events: WatchEvents) -> None:
    """Pass over, with a note, each checkpoint training wrote while the watcher ran (metrics.jsonl's checkpoint
    events) that retention deleted before the watcher looked: it fell behind, and keep_checkpoints is small."""
    looked_at = {name for name, _ in seen} | set(summary.passed_over)
    for record in iter_metrics(run_dir):
        if record.get("kind") != "event" or record.get("event") != "checkpoint":
            continue
        written, path = record.get("time"), record.get("path")
        if not isinstance(written, (int, float)) or written < since or not isinstance(path, str):
            continue
        name = Path(path).name
        if step_of(Path(name)) is not None and name not in looked_at and not (checkpoints_dir(run_dir) / name).exists():
            why = "deleted by the training's retention (keep_checkpoints) before the watcher looked"
            summary.passed_over[name] = why
            looked_at.add(name)
            events.passed_over(name, why)


def score(rt: Any, run_dir: Path, path: Path, opts: EvalOptions, progress: Progress) -> dict[str, Any] | None:
    """The evaluation of the checkpoint at `path`, held for its whole length; None when it was deleted before the
    hold was taken."""
    with Hold(run_dir, path.name):
        if not still_there(path):
            return None
        return evaluate_run(rt, run_dir, replace(opts, checkpoint=str(path)), progress)


def _meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = read_meta(path / "meta.json")
    except CheckpointError:
        return None
    return meta if isinstance(meta, dict) else None


def _run_complete(run_dir: Path, seen: set[tuple[str, str]]) -> bool:
    """Whether training has ended its run: `latest` names a checkpoint at the run's last step (its config
    snapshot's), which this watcher has seen."""
    name = read_pointer(checkpoints_dir(run_dir), "latest")
    if name is None or step_of(Path(name)) is None:
        return False
    path = checkpoints_dir(run_dir) / name
    meta = _meta(path)
    if meta is None or (name, checkpoint_id(meta)) not in seen:
        return False
    try:
        total = run_config_from_snapshot(run_dir, Checkpoint(path=path, meta=meta)).total_steps
    except CheckpointError:
        return False
    return step_of(path) >= total


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """Ctrl-C, and SIGTERM (a scheduler stopping the job), end the watcher: its hold released, its summary said.
    SIGINT is set here too, not left to Python: a process started with SIGINT ignored (a background job of a
    script) keeps it ignored, and its Ctrl-C would never stop the watcher."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
