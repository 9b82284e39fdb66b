"""`nanopt train` end to end on the CPU: DDP and FSDP equal one process, exact resume after SIGKILL,
uneven eval under two ranks, the schedule and the run directory it leaves.

Single-process runs are real `nanopt train` processes forked from the warm launcher (tests/faulthelp.py). Two-rank
runs call the library's `train` on two gloo ranks set up as torchrun sets them up (tests/distributed.py); the
launcher itself, `--nproc-per-node 2`, is tested in tests/test_faults.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import run_ranks
from faulthelp import Launcher
from trainhelp import HIDE_CUDA, eval_losses, final_weights_hash, losses, make_run

from nanopt.train import checkpoint as ckpt


def train_in_rank(run: Path) -> dict[str, Any]:
    """What `nanopt train RUN` does in each torchrun worker, without the CLI's rendering: the run's summary."""
    from nanopt.config import load_run
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run), TrainOptions())


# What every rank must agree on at the end of a run (time and throughput are each rank's own).
AGREED = ("steps", "tokens", "final_train_loss", "final_val_loss", "best_val_loss", "skipped_steps",
          "latest_checkpoint", "best_checkpoint", "completed")


def train_on_two_ranks(run: Path) -> dict[str, Any]:
    """Rank 0's summary, after checking that rank 1 ended the same run."""
    rank0, rank1 = run_ranks(train_in_rank, run, env=HIDE_CUDA)
    assert {k: rank0[k] for k in AGREED} == {k: rank1[k] for k in AGREED}
    assert rank0["completed"]
    meta = json.loads((run / "checkpoints" / rank0["latest_checkpoint"] / "meta.json").read_text())
    assert meta["world_size"] == 2  # one run over two ranks, not one process twice
    return rank0


def assert_losses_close(a: dict[int, float], b: dict[int, float], tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b) and len(a) == 20
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= tol, f"largest per-step loss difference {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_match_one_rank_with_accumulation(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                                    parallelism: str):
    single = make_run(tmp_path, tiny_dataset, "single", parallelism=parallelism)
    double = make_run(tmp_path, tiny_dataset, "double", parallelism=parallelism)
    launcher.train(single)  # 1 rank x accumulation 2
    train_on_two_ranks(double)  # 2 gloo ranks x accumulation 1
    assert_losses_close(losses(single), losses(double))
    first, last = losses(single)[1], losses(single)[20]
    assert last < first - 0.5  # and it learns


# On CUDA, attention's backward and cuBLAS's reductions are not bit-reproducible run to run; in fp32 (TF32 matmuls)
# the two runs' per-step losses then drift apart by far less than this after the resume, in nats.
RESUME_TOL_CUDA = 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_sigkill_once_step_10_is_saved_then_resume_is_identical(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                                                device: str):
    """Bit-identical losses, evaluations and weights on the CPU (the launcher hides any GPU). On CUDA (the gpu
    marker) the losses after the resume agree within RESUME_TOL_CUDA nats, the weights are not compared bit-wise."""
    gpu = device == "cuda"
    straight = make_run(tmp_path, tiny_dataset, "straight")
    killed = make_run(tmp_path, tiny_dataset, "killed")
    launcher.train(straight, gpu=gpu)
    # The run kills itself as it reads step 13's first batch, once `latest` names step 10 (its background save
    # complete): a known point, however fast the steps are. A kill sent from here when a poll sees step 10 saved
    # can come too late on a GPU, where the ten steps after that save take milliseconds.
    child = launcher.start("train", killed, "--no-live", gpu=gpu, kill_at_step={
        "step": 13, "checkpoints": str(killed / "checkpoints"), "latest": "step-000010"})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"
    assert ckpt.read_pointer(killed / "checkpoints", "latest") == "step-000010"
    assert _steps_so_far(killed) == set(range(1, 13))
    result = launcher.train(killed, gpu=gpu)
    assert "resumed from" in result.stderr and "step 10" in result.stderr
    a, b = losses(straight), losses(killed)
    if gpu:
        assert max(abs(a[s] - b[s]) for s in range(11, 21)) <= RESUME_TOL_CUDA, (a, b)
        va, vb = eval_losses(straight), eval_losses(killed)
        assert sorted(va) == sorted(vb) and max(abs(va[s] - vb[s]) for s in va) <= RESUME_TOL_CUDA, (va, vb)
        return
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
    summary = train_on_two_ranks(run)
    assert sorted(eval_losses(run)) == [3, 6]
    assert summary["final_val_loss"] == eval_losses(run)[6]


def test_run_directory_contents_and_summary(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, max_steps=10, checkpoint_interval=5, keep_checkpoints=1)
    summary = json.loads(launcher.train(run, "--json").stdout)
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


def test_lr_in_metrics_follows_the_schedule(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    from nanopt.config import load_run
    from nanopt.train.optim.schedule import lr_at

    run = make_run(tmp_path, tiny_dataset, max_steps=10, eval_interval=0)
    launcher.train(run)
    cfg = load_run(run)
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in (r for r in logged if r["kind"] == "train"):
        assert record["lr"] == pytest.approx(lr_at(record["step"] - 1, 10, cfg.train))


def test_a_checkpoint_older_than_a_setting_resumes_as_if_it_had_the_default(tmp_path: Path, tiny_dataset: Path,
                                                                             cli_in_process):
    """Keys nanopt gained after a checkpoint was written (optimizer, price_per_hour, ...) are not changes."""
    run = make_run(tmp_path, tiny_dataset, max_steps=4, checkpoint_interval=2, eval_interval=0)
    assert cli_in_process("train", run, "--set", "max_steps=2").returncode == 0
    meta_path = run / "checkpoints" / "step-000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("optimizer", "price_per_hour", "on_exit"):
        meta["config"]["train"].pop(key, None)
    meta_path.write_text(json.dumps(meta))
    resumed = cli_in_process("train", run, "--allow-changed")  # max_steps 2 -> 4 is the only change
    assert resumed.returncode == 0, resumed.stderr
    assert "train.optimizer" not in resumed.stderr and "resumed from" in resumed.stderr


def test_resume_with_changed_model_is_refused_with_the_keys(tmp_path: Path, tiny_dataset: Path,
                                                            launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, max_steps=5, checkpoint_interval=5, eval_interval=0)
    launcher.train(run)
    result = launcher.run("train", run, "--no-live", "--set", "max_steps=8", "--set", "learning_rate=1e-3")
    assert result.returncode == 2 and "train.learning_rate" in result.stderr and "--allow-changed" in result.stderr
    launcher.train(run, "--set", "max_steps=8", "--set", "learning_rate=1e-3", "--allow-changed")
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "hidden_size": 64}))
    result = launcher.run("train", run, "--no-live", "--allow-changed")
    assert result.returncode == 2 and "model.hidden_size: 32 -> 64" in result.stderr
