"""fp16 mixed precision with dynamic loss scaling (train.json "precision": "fp16"; "auto" on a GPU without bf16):
refused on the CPU in one line; on CUDA the GradScaler's state is in the checkpoint, and a run killed and resumed
scales and trains as the uninterrupted one."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from faulthelp import Launcher
from trainhelp import HIDE_CUDA, losses, make_run

from nanopt.train import checkpoint as ckpt

RESUME_TOL_CUDA = 1e-3  # as tests/test_train.py: CUDA's attention backward is not bit-reproducible run to run


def test_fp16_on_the_cpu_is_a_one_line_error(tmp_path: Path, tiny_dataset: Path, cli_in_process, monkeypatch):
    for name, value in HIDE_CUDA.items():
        monkeypatch.setenv(name, value)
    if torch.cuda.is_available():
        pytest.skip("this process already sees a GPU (CUDA_VISIBLE_DEVICES is read once)")
    run = make_run(tmp_path, tiny_dataset, precision="fp16")
    assert_user_error(cli_in_process("train", run, "--no-live"), "'precision': fp16 needs a CUDA GPU")
    assert not (run / "checkpoints").exists()


def test_a_checkpoint_with_a_bad_loss_scale_is_refused(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, max_steps=2, checkpoint_interval=2, eval_interval=0)
    assert cli_in_process("train", run, "--no-live").returncode == 0
    meta_path = ckpt.resolve(run, "latest").path / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert "loss_scale" not in meta  # fp32: no scaler
    meta["loss_scale"] = {"scale": -1.0, "growth_tracker": 0}
    meta_path.write_text(json.dumps(meta))
    result = cli_in_process("train", run, "--no-live", "--set", "max_steps=4", "--allow-changed")
    assert result.returncode != 0 and "loss_scale.scale" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 needs CUDA")
def test_fp16_sigkill_and_resume_continues_the_loss_scale(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    straight = make_run(tmp_path, tiny_dataset, "straight", precision="fp16")
    killed = make_run(tmp_path, tiny_dataset, "killed", precision="fp16")
    launcher.train(straight, gpu=True)
    child = launcher.start("train", killed, "--no-live", gpu=True, kill_at_step={
        "step": 13, "checkpoints": str(killed / "checkpoints"), "latest": "step-000010"})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"
    saved = json.loads((ckpt.resolve(killed, "latest").path / "meta.json").read_text())
    reference = json.loads((straight / "checkpoints" / "step-000010" / "meta.json").read_text())
    assert saved["loss_scale"] == reference["loss_scale"] and saved["loss_scale"]["scale"] > 0
    assert saved["skipped_steps"] == reference["skipped_steps"]  # overflow skips counted as non-finite steps
    result = launcher.train(killed, gpu=True)
    assert "resumed from" in result.stderr and "step 10" in result.stderr
    a, b = losses(straight), losses(killed)
    assert max(abs(a[s] - b[s]) for s in range(11, 21)) <= RESUME_TOL_CUDA, (a, b)
    last = {run: json.loads((ckpt.resolve(run, "latest").path / "meta.json").read_text()) for run in (straight, killed)}
    assert last[straight]["loss_scale"] == last[killed]["loss_scale"]
    assert last[straight]["skipped_steps"] == last[killed]["skipped_steps"]
