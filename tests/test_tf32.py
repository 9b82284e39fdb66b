"""train.json "tf32": fp32 matmuls on TF32 tensor cores (the default on CUDA) or in true fp32, the reference a bf16
run is compared with. Set through the legacy flags only (nanopt.runtime.with_tf32), and recorded where it matters."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clihelp import REPO

from nanopt.config import load_run
from nanopt.devices import device_peak_flops
from nanopt.plan.preflight_record import changed_setting, fingerprint
from nanopt.runtime import init_runtime


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(REPO / "runs" / "gpt2-small", target)
    return target


def test_tf32_is_on_unless_train_json_or_set_turns_it_off(run_dir: Path):
    assert load_run(run_dir).train.tf32 is True
    assert load_run(run_dir, {"tf32": False}).train.tf32 is False
    train = json.loads((run_dir / "train.json").read_text())
    (run_dir / "train.json").write_text(json.dumps({**train, "tf32": False}))
    run = load_run(run_dir)
    assert run.train.tf32 is False and run.snapshot()["train"]["tf32"] is False  # checkpoints record it


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's runtime (CUDA stays uninitialized in this process)")
def test_on_the_cpu_nothing_is_set_and_the_runtime_says_no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for wanted in (True, False):
        rt = init_runtime("fp32", tf32=wanted)
        assert rt.device.type == "cpu" and rt.tf32 is False
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_true_fp32_is_not_measured_against_the_tf32_peak():
    peak, source = device_peak_flops(torch.device("cuda", 0), "fp32", tf32=False)
    assert peak is None and '"tf32": false' in source


def test_a_preflight_from_before_the_setting_is_still_current_but_not_after_turning_tf32_off(run_dir: Path):
    run = load_run(run_dir)
    recorded = {key: value for key, value in fingerprint(run, 1).items() if key != "tf32"}  # an older preflight.json
    assert changed_setting(recorded, fingerprint(run, 1)) is None
    off = fingerprint(load_run(run_dir, {"tf32": False}), 1)
    assert changed_setting(recorded, off) == "tf32: true when measured, false now"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_tf32_off_is_true_fp32_for_eager_and_compiled_matmuls():
    # A fresh process: the flags are global. Both APIs must agree, and Inductor must compile under each setting
    # (setting the newer per-backend fp32_precision beside the legacy flags makes torch raise "mix of the legacy and
    # new APIs").
    code = """
import torch
from nanopt.runtime import init_runtime, with_tf32
rt = init_runtime("fp32", tf32=False)
f = torch.compile(lambda a, b: a @ b)
a = torch.randn(256, 256, device="cuda")
exact = (a.double() @ a.double()).float()
off = (rt.tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
       getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), (f(a, a) - exact).abs().max().item())
rt = with_tf32(rt, True)
on = (rt.tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
      getattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), (a @ a - exact).abs().max().item())
print(repr((off, on)))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    off, on = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert off[:4] == (False, False, False, "ieee") and on[:4] == (True, True, True, "tf32")
    assert off[4] < 1e-3 < on[4]  # fp32's 24-bit mantissa against TF32's 11 bits, over sums of 256 products


def test_eval_scores_a_run_in_its_own_precision_and_records_it(tmp_path: Path, tiny_dataset: Path, launcher):
    # Not "auto" (bf16 on any GPU): a bf16 run in bf16 (here on the CPU), as its in-loop validation measured it.
    from faulthelp import tiny_run

    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, eval_interval=0, precision="bf16")
    launcher.train(run)
    result = launcher.run("eval", run, "--json", "--tokens", "256")
    assert result.status == 0, result.stderr[-3000:]
    record = json.loads(result.stdout)  # one run: its record
    assert record["precision"] == "bf16" and record["tf32"] is False  # no TF32 off a GPU
