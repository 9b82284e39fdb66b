"""`nanopt eval RUN --watch`: the options checked, the watcher (nanopt.evaluate.watch) run, and a line per
checkpoint as it is scored (with --json: one JSON object per line, then the summary)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from nanopt.cli.app import console
from nanopt.errors import ConfigError

STOPPED = 130  # Ctrl-C / SIGTERM: the shell's convention, as `nanopt train` uses


def check_device_option(device: str | None, nproc_per_node: int) -> None:
    """--device names one device for one process: with several, every rank would refuse it after torchrun started."""
    if device is not None and nproc_per_node > 1:
        raise ConfigError(f"--device {device} picks one device for one process, and --nproc-per-node is "
                          f"{nproc_per_node}", "drop --device (each rank uses its own GPU), or --nproc-per-node")


def check_watch_options(run_dirs: list[Path], nproc_per_node: int, poll: float) -> None:
    """One line, before anything starts, for what --watch cannot do."""
    from nanopt.evaluate.watch import check_poll

    hint = "e.g. nanopt eval runs/NAME --watch --device cpu"
    if len(run_dirs) > 1:
        raise ConfigError(f"--watch follows one run, and {len(run_dirs)} were given", hint)
    if nproc_per_node > 1:
        raise ConfigError("--watch scores in one process, beside the training", "drop --nproc-per-node; pick the "
                          "device with --device")
    check_poll(poll)


def watch(run_dir: Path, opts: Any, poll: float, device: str | None, as_json: bool, progress: Any) -> None:
    """Run the watcher until the run completes (exit 0) or Ctrl-C / SIGTERM (exit 130)."""
    from nanopt.evaluate.watch import watch_run

    summary = watch_run(run_dir, opts, poll_s=poll, device=device, events=_Lines(run_dir, poll, as_json),
                        progress=progress)
    if as_json:
        _json_line({"summary": asdict(summary)})
    else:
        _say_summary(summary)
    if summary.ended != "completed":
        raise typer.Exit(STOPPED)


class _Lines:
    """A line per checkpoint: scored (stdout), skipped or passed over (stderr)."""

    def __init__(self, run_dir: Path, poll: float, as_json: bool) -> None:
        self.run_dir, self.poll, self.as_json = run_dir, poll, as_json

    def started(self, device: str) -> None:
        console(stderr=True).print(escape(f"watching {self.run_dir}: each new checkpoint scored on {device}, a look "
                                          f"every {self.poll:g} s; Ctrl-C stops"), soft_wrap=True)

    def scored(self, result: dict[str, Any]) -> None:
        if self.as_json:
            _json_line(result)
            return
        name = Path(result["checkpoint"]).name
        tasks = "".join(f", {task} {_headline(metrics)}" for task, metrics in (result.get("tasks") or {}).items())
        console().print(escape(f"{name}: test loss {result['test_loss']:.4f}, {result['bits_per_byte']:.4f} bits "
                               f"per byte{tasks} ({result['eval_seconds']:.1f} s)"), soft_wrap=True)

    def skipped(self, name: str) -> None:
        console(stderr=True).print(escape(f"{name}: scored before (eval_history.jsonl), skipped"), soft_wrap=True)

    def passed_over(self, name: str, why: str) -> None:
        console(stderr=True).print(f"[yellow]note:[/] {escape(name)}: not scored: {escape(why)}", soft_wrap=True)


def _headline(metrics: Any) -> str:
    """acc_norm where the task has it (the harness's headline), else acc, in percent."""
    if not isinstance(metrics, dict):
        return "-"
    for key in ("acc_norm", "acc"):
        value = metrics.get(key)
        value = value.get("value") if isinstance(value, dict) else value
        if isinstance(value, (int, float)):
            return f"{key} {100 * value:.1f}%"
    return "-"


def _say_summary(summary: Any) -> None:
    ended = "the run is complete" if summary.ended == "completed" else "stopped"
    console(stderr=True).print(escape(f"{summary.run}: {len(summary.scored)} checkpoint(s) scored, "
                                      f"{len(summary.skipped)} scored before, {len(summary.passed_over)} not scored; "
                                      f"{ended}"), soft_wrap=True)


def _json_line(data: Any) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()
