"""The loss trend `nanopt train`'s end-of-run table shows is the one `nanopt eval --health` (and `nanopt health`) shows
for the same run, in the same words, and the last train record of metrics.jsonl holds that figure too: all are
the run-health monitor's, over the blocks the run recorded. The window's label never claims more steps than the run
has: a short run's window is a quarter of it (a 59-step run at log_interval 10: 10 steps, whatever the log
interval), and a run stopped before its first window is full names the steps it has."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from trainhelp import make_run


def _trend_row(table: str) -> str:
    [row] = [line for line in table.splitlines() if "loss trend (" in line]
    return " ".join(row.replace("│", " ").split())


def _stop_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """A SIGTERM (a scheduler's, or Ctrl-C) as the loader hands out step `step`'s data: the run saves that step and
    stops, printing its table."""
    from nanopt.data.loaders.loader import TrainLoader

    original = TrainLoader.next_batch

    def next_batch(self):
        if self.step == step - 1 and self.micro_step == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(TrainLoader, "next_batch", next_batch)


def _train_and_replay(cli_in_process, run: Path) -> tuple[str, str, dict]:
    trained = cli_in_process("train", run, "--no-live")
    assert trained.returncode in (0, 75), trained.stderr  # 75: stopped early, saved
    replayed = cli_in_process("eval", run, "--health")
    assert replayed.returncode == 0, replayed.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["kind"] == "train"][-1]
    return _trend_row(trained.stdout), _trend_row(replayed.stdout), last


def test_a_59_step_run_logging_every_10_says_one_trend_over_its_own_window(tmp_path: Path, tiny_dataset: Path,
                                                                            cli_in_process):
    run = make_run(tmp_path, tiny_dataset, max_steps=59, log_interval=10, eval_interval=0, checkpoint_interval=30)
    trained, replayed, last = _train_and_replay(cli_in_process, run)
    assert trained == replayed == f"loss trend (last 10 steps) {last['loss_trend']:+.2%}"
    assert last["step"] == 59


def test_a_run_stopped_before_its_window_names_the_steps_it_has(tmp_path: Path, tiny_dataset: Path,
                                                                 cli_in_process, monkeypatch: pytest.MonkeyPatch):
    # 400 steps: a window of 100 (blocks of 10); stopped at step 59, with five blocks ended (steps 1-50).
    run = make_run(tmp_path, tiny_dataset, max_steps=400, log_interval=1, eval_interval=0, checkpoint_interval=100)
    _stop_at(monkeypatch, 59)
    trained, replayed, last = _train_and_replay(cli_in_process, run)
    assert last["step"] == 59
    assert trained == replayed == f"loss trend (last 59 steps) {last['loss_trend']:+.2%}"


def test_a_run_stopped_before_five_blocks_says_what_its_trend_waits_for(tmp_path: Path, tiny_dataset: Path,
                                                                         cli_in_process,
                                                                         monkeypatch: pytest.MonkeyPatch):
    run = make_run(tmp_path, tiny_dataset, max_steps=400, log_interval=10, eval_interval=0, checkpoint_interval=100)
    _stop_at(monkeypatch, 45)  # four blocks of 10 ended; the signals are step 40's, the last logged
    trained, replayed, last = _train_and_replay(cli_in_process, run)
    assert last["loss_trend"] is None and last["step"] == 40
    assert trained == replayed == ("loss trend (last 40 steps) - (fitted once 5 blocks of 10 steps hold a finite "
                                   "loss)")
