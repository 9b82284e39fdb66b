"""Automatic recovery (nanopt.train.guard.recovery): a run that spikes or diverges rolls back to a checkpoint from
before it, skips the data it was reading, lowers the learning rate and trains on; within max_recoveries, else it stops
with the divergence error.

The trouble is real: a 30-step run resumed with a learning rate raised through --set (--allow-changed), as a person
might, spikes (10) or diverges (1e30) in its next steps. A tiny recovery_lr_factor and a ramp longer than the test
bring the rate back down to a sane one, so the recovered run must train on."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from faulthelp import Launcher, tiny_run
from trainhelp import losses

from nanopt.train import checkpoint as ckpt

# The base run's samples per optimizer step: global_batch_tokens 64 / seq_len 16.
SAMPLES_PER_STEP = 4
SKIP_STEPS = 10  # recovery_skip_steps' default
# Back to the base run's 3e-3 after a rollback, and kept there for the rest of the test.
SANE_AGAIN = ("--set", "recovery_lr_steps=1000000", "--allow-changed")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """30 healthy steps, a checkpoint every 5 (enough history for the spike watch: 20 losses)."""
    run = tiny_run(tmp_path_factory.mktemp("recovery"), tiny_dataset, "base", max_steps=30, checkpoint_interval=5,
                   eval_interval=0)
    launcher.train(run)
    return run


def events(run: Path, name: str) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == name]


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_recovered(run: Path, stderr: str, reason: str, to_step: int, last_step: int) -> dict:
    """One recovery of `reason` back to `to_step`, said in the log, and a finished run with a finite final loss below
    the loss that triggered it."""
    [event] = events(run, "recovery")
    assert event["reason"] == reason and event["to_step"] == to_step and event["recovery"] == 1
    assert event["skipped_samples"] == (event["step"] - to_step + SKIP_STEPS) * SAMPLES_PER_STEP
    assert f"step {event['step']}: " in stderr and f"recovery 1 of 3: rolled back to {ckpt.step_dir_name(to_step)}" \
        in stderr
    final = losses(run)[last_step]
    assert math.isfinite(final) and (not math.isfinite(event["loss"]) or final < event["loss"])
    assert ckpt.resolve(run, "latest").step == last_step
    return event


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_loss_spike_rolls_back_skips_the_data_lowers_the_rate_and_the_run_finishes(base: Path, tmp_path: Path,
                                                                                      launcher: Launcher, nproc: int):
    run = shutil.copytree(base, tmp_path / "run")
    result = launcher.train(run, "--nproc-per-node", str(nproc), "--set", "max_steps=40", "--set",
                            "learning_rate=10", "--set", "recovery_lr_factor=0.0003", *SANE_AGAIN)
    event = assert_recovered(run, result.stderr, "spike", to_step=30, last_step=40)
    # The first loss after one step at the new rate (31) is the first spiking one, confirmed 3 steps later.
    assert event["step"] == 34 and "loss spike from step 32 to 34" in event["detail"]
    assert event["loss"] > 2 * losses(base)[30]
    # The rates logged after the rollback are the ones used: the schedule's times the recovery factor.
    lrs = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if r["kind"] == "train"}
    assert lrs[31] < 10 * 0.0003 * 1.001
    # The ramp and the count are in the checkpoint, so a resume continues them.
    saved = ckpt.resolve(run, "latest").meta["recovery"]
    assert saved["recoveries"] == 1 and saved["lr_ramp_start"] == 30 and saved["lr_ramp_factor"] == pytest.approx(3e-4)
    if nproc == 1:  # resumed during the ramp, the run goes on at the lowered rate
        launcher.train(run, "--set", "max_steps=42", "--set", "learning_rate=10", "--set",
                       "recovery_lr_factor=0.0003", *SANE_AGAIN)
        assert all(r["lr"] < 10 * 0.0003 * 1.001 for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                                              .splitlines()) if r["kind"] == "train" and r["step"] > 40)
        assert not events(run, "recovery")[1:] and math.isfinite(losses(run)[42])


def test_no_checkpoint_is_saved_during_a_spike_so_the_one_before_it_is_kept(base: Path, tmp_path: Path,
                                                                            launcher: Launcher):
    """A checkpoint every step, two kept: those of the spiking steps would push out the last one from before it."""
    run = shutil.copytree(base, tmp_path / "run")
    result = launcher.train(run, "--set", "max_steps=36", "--set", "learning_rate=10", "--set",
                            "recovery_lr_factor=0.0003", "--set", "checkpoint_interval=1", "--set",
                            "keep_checkpoints=2", *SANE_AGAIN)
    # The weights step 31 left (at the new rate) gave the first spiking loss: back to step 30's.
    assert_recovered(run, result.stderr, "spike", to_step=30, last_step=36)
    assert [e["step"] for e in events(run, "checkpoint_skipped")] == []  # rolled back with the steps they were in
    assert "step 32: checkpoint not saved during a loss spike" in result.stderr


def test_divergence_rolls_back_and_trains_on(base: Path, tmp_path: Path, launcher: Launcher):
    run = shutil.copytree(base, tmp_path / "run")
    # 1e17 overflows in the second step; a ramp back to it must be about as long as a 64-bit count allows to stay
    # sane for the rest of the test.
    result = launcher.train(run, "--set", "max_steps=40", "--set", "learning_rate=1e17", "--set",
                            "recovery_lr_factor=3e-20", *SANE_AGAIN, "--set", f"recovery_lr_steps={2 ** 63 - 1}")
    event = assert_recovered(run, result.stderr, "nonfinite", to_step=30, last_step=40)
    assert event["step"] == 36 and "5 non-finite steps in a row at step 36" in event["detail"]
    assert not events(run, "nonfinite_skipped")  # the skipped steps were rolled back and trained again


def test_max_recoveries_spent_stops_with_the_divergence_error(base: Path, tmp_path: Path, launcher: Launcher):
    run = shutil.copytree(base, tmp_path / "run")
    before = ckpt.resolve(run, "latest").path.name
    result = launcher.run("train", run, "--no-live", "--set", "max_steps=60", "--set", "learning_rate=1e30",
                          "--set", "max_recoveries=2", "--allow-changed")
    assert result.status == 2, result.stderr[-3000:]
    [error] = error_lines(result.stderr)
    assert "training diverged: 5 non-finite steps in a row at step 36, after 2 automatic recoveries" in error
    assert "Hint: resume from the last checkpoint with a lower learning rate" in error
    assert result.stderr.count("rolled back to step-000030") == 2
    assert ckpt.read_pointer(run / "checkpoints", "latest") == before  # no diverged weights became `latest`


def test_no_checkpoint_before_the_trouble_stops_with_the_divergence_error(tmp_path: Path, tiny_dataset: Path,
                                                                          launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "fresh", max_steps=20, learning_rate=1e30, eval_interval=0)
    result = launcher.run("train", run, "--no-live")
    assert result.status == 2, result.stderr[-3000:]
    [error] = error_lines(result.stderr)
    # Step 1's update gave step 2 its NaN: the weights before it are the initial ones, which no checkpoint holds.
    assert "non-finite steps in a row at step 6, the first at step 2: no checkpoint is from before it (the initial " \
        "weights are never saved), nothing to roll back to" in error and "step 0" not in error
    assert "start again with a lower learning rate" in error and "--resume none --set learning_rate=1e+29" in error


def test_recovery_off_stops_as_before(base: Path, tmp_path: Path, launcher: Launcher):
    run = shutil.copytree(base, tmp_path / "run")
    result = launcher.run("train", run, "--no-live", "--set", "max_steps=40", "--set", "learning_rate=1e30",
                          "--set", "recovery=false", "--allow-changed")
    assert result.status == 2, result.stderr[-3000:]
    [error] = error_lines(result.stderr)
    assert "training diverged: 5 non-finite steps in a row at step 36. Hint:" in error  # as before recovery existed
    assert not events(run, "recovery") and "rolled back" not in result.stderr


@pytest.mark.parametrize("key, value, why", [("recovery_lr_factor", "0", "is outside (0, 1]"),
                                             ("recovery_lr_factor", "1.5", "is outside (0, 1]"),
                                             ("recovery_confirm_steps", "0", "must be positive"),
                                             ("max_recoveries", "-1", "must be positive"),
                                             ("recovery_skip_steps", "-1", "must not be negative")])
def test_bad_recovery_settings_are_one_clear_line(base: Path, cli_in_process, key: str, value: str, why: str):
    result = cli_in_process("train", base, "--no-live", "--set", f"{key}={value}")
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert f"key '{key}': " in line and why in line and "Hint:" in line and "Traceback" not in result.stderr
