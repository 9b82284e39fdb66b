"""`nanopt train` end to end on the CPU: DDP and FSDP equal one process, exact resume after SIGKILL,
uneven eval under two ranks, the schedule and the run directory it leaves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clihelp import REPO, run_cli
from trainhelp import eval_losses, final_weights_hash, losses, make_run


def train(run: Path, *args: str, timeout: float = 240):
    result = run_cli("train", run, "--no-live", *args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_losses_close(a: dict[int, float], b: dict[int, float], tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b) and len(a) == 20
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= tol, f"largest per-step loss difference {worst}"


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_match_one_rank_with_accumulation(tmp_path: Path, tiny_dataset: Path, parallelism: str):
    single = make_run(tmp_path, tiny_dataset, "single", parallelism=parallelism)
    double = make_run(tmp_path, tiny_dataset, "double", parallelism=parallelism)
    train(single)  # 1 rank x accumulation 2
    train(double, "--nproc-per-node", "2")  # 2 gloo ranks x accumulation 1
    assert_losses_close(losses(single), losses(double))
    first, last = losses(single)[1], losses(single)[20]
    assert last < first - 0.5  # and it learns


def test_sigkill_during_step_13_then_resume_is_identical(tmp_path: Path, tiny_dataset: Path):
    straight = make_run(tmp_path, tiny_dataset, "straight")
    killed = make_run(tmp_path, tiny_dataset, "killed")
    train(straight)
    proc = subprocess.Popen([sys.executable, "-m", "nanopt", "train", str(killed), "--no-live"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and 12 not in _steps_so_far(killed):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 12 in _steps_so_far(killed) and 20 not in _steps_so_far(killed)
    result = train(killed)
    assert "resumed from" in result.stderr and "step 10" in result.stderr
    a, b = losses(straight), losses(killed)
    assert [a[s] for s in range(11, 21)] == [b[s] for s in range(11, 21)]
    assert final_weights_hash(straight) == final_weights_hash(killed)
    assert eval_losses(straight) == eval_losses(killed)


def _steps_so_far(run: Path) -> set[int]:
    try:
        return set(losses(run))
    except (FileNotFoundError, json.JSONDecodeError):
        return set()


def test_uneven_eval_with_two_ranks_finishes(tmp_path: Path, tiny_dataset: Path):
    # 7 eval windows of 32 tokens over 2 ranks x micro-batch 4 cannot split evenly; every rank must still agree.
    run = make_run(tmp_path, tiny_dataset, max_steps=6, eval_interval=3, eval_tokens=7 * 32,
                   checkpoint_interval=3, global_batch_tokens=4 * 32 * 2, micro_batch_size=2)
    result = run_cli("train", run, "--no-live", "--nproc-per-node", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(eval_losses(run)) == [3, 6]


def test_run_directory_contents_and_summary(tmp_path: Path, tiny_dataset: Path):
    run = make_run(tmp_path, tiny_dataset, max_steps=10, checkpoint_interval=5, keep_checkpoints=1)
    summary = json.loads(train(run, "--json").stdout)
    assert summary["completed"] and summary["steps"] == 10 and summary["tokens"] == 10 * 256
    assert summary["final_val_loss"] is not None and summary["best_checkpoint"]
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-000010"
    kept = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-"))
    assert "step-000010" in kept and len(kept) <= 2  # keep 1, plus `best` if it is an older one
    assert (run / "loss.png").stat().st_size > 1000
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_record = next(r for r in records if r["kind"] == "train")
    assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s",
            "peak_memory_bytes"} <= train_record.keys()


def test_lr_in_metrics_follows_the_schedule(tmp_path: Path, tiny_dataset: Path):
    from nanopt.config import load_run
    from nanopt.train.schedule import lr_at

    run = make_run(tmp_path, tiny_dataset, max_steps=10, eval_interval=0)
    train(run)
    cfg = load_run(run)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in (r for r in logged if r["kind"] == "train"):
        assert record["lr"] == pytest.approx(lr_at(record["step"] - 1, 10, cfg.train))


def test_resume_with_changed_model_is_refused_with_the_keys(tmp_path: Path, tiny_dataset: Path):
    run = make_run(tmp_path, tiny_dataset, max_steps=5, checkpoint_interval=5, eval_interval=0)
    train(run)
    result = run_cli("train", run, "--no-live", "--set", "max_steps=8", "--set", "learning_rate=1e-3")
    assert result.returncode == 2 and "train.learning_rate" in result.stderr and "--allow-changed" in result.stderr
    train(run, "--set", "max_steps=8", "--set", "learning_rate=1e-3", "--allow-changed")
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "hidden_size": 64}))
    result = run_cli("train", run, "--no-live", "--allow-changed")
    assert result.returncode == 2 and "model.hidden_size: 32 -> 64" in result.stderr
