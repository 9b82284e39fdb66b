"""The lifecycle after training, on CUDA: eval (loss, samples) and export of a checkpoint a GPU run wrote with its
defaults (bf16, torch.compile). The first H100 window trained and profiled but never evaluated or exported there."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from faulthelp import Launcher
from trainhelp import losses, make_run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_run_trains_evaluates_and_exports_with_its_defaults(tmp_path: Path, tiny_dataset: Path,
                                                                  launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, precision="auto", compile="auto", max_steps=6, eval_interval=3,
                   checkpoint_interval=3)
    launcher.train(run, gpu=True)
    trained = losses(run)
    assert sorted(trained) == list(range(1, 7)) and all(math.isfinite(v) for v in trained.values())
    meta = json.loads((run / "checkpoints" / "step-000006" / "meta.json").read_text())
    assert meta["device_type"] == "cuda"

    scored = launcher.run("eval", run, "--json", "--max-new-tokens", "8", gpu=True)
    assert scored.status == 0, scored.stderr[-3000:]
    report = json.loads(scored.stdout)
    assert math.isfinite(report["test_loss"]) and report["samples"], report

    exported = launcher.run("export", run, "--out", tmp_path / "hf", "--json", gpu=True)
    assert exported.status == 0, exported.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
