"""The suite on a host with one GPU: commands and ranks a test starts see no GPU unless the test asks for one and
the host has a GPU per rank, and the tiny runs stand for CPU numbers (fp32, no compile) wherever they run.

Pure functions of tests/trainhelp.py and the launcher's real forked commands; no GPU needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from faulthelp import Launcher
from trainhelp import HIDE_CUDA, device_env, make_run, world_size_of


def test_ranks_see_no_gpu_where_the_host_has_fewer_gpus_than_ranks():
    assert device_env(2, gpu=True, gpus=1) == HIDE_CUDA  # one H100: rank 1 would ask for cuda:1
    assert device_env(2, gpu=True, gpus=0) == HIDE_CUDA
    assert device_env(2, gpu=True, gpus=2) == {}  # a GPU per rank, and the test asked for them
    assert device_env(1, gpu=True, gpus=1) == {}


def test_commands_see_no_gpu_unless_the_test_asks_for_one():
    assert device_env(1, gpu=False, gpus=8) == HIDE_CUDA
    assert device_env(4, gpus=8) == HIDE_CUDA


def test_the_ranks_of_a_command_are_its_nproc_per_node():
    assert world_size_of(["train", "runs/x", "--no-live", "--nproc-per-node", "2"]) == 2
    assert world_size_of(["find-batch", "runs/x", "--nproc-per-node=4", "--json"]) == 4
    assert world_size_of(["train", "runs/x", "--nnodes", "2", "--node-rank", "0"]) == 1


def test_tiny_runs_are_fp32_without_compile_unless_a_test_says_otherwise(tmp_path: Path, tiny_dataset: Path):
    train = json.loads((make_run(tmp_path, tiny_dataset, "plain") / "train.json").read_text())
    assert train["precision"] == "fp32" and train["compile"] is False
    chosen = json.loads((make_run(tmp_path, tiny_dataset, "gpu", precision="auto", compile=True) / "train.json")
                        .read_text())
    assert chosen["precision"] == "auto" and chosen["compile"] is True


def test_a_launched_command_gets_the_hidden_gpu_in_its_environment(tmp_path: Path, launcher: Launcher):
    # `nanopt train --on-exit` runs a hook in the command's own environment: the hook writes what it saw.
    seen = tmp_path / "seen.txt"
    hook = f"printenv CUDA_VISIBLE_DEVICES > {seen}; echo set=$? >> {seen}"
    child = launcher.run("train", tmp_path / "missing", "--no-live", "--on-exit", hook)
    assert child.status == 2  # the run does not exist: a user error, after which the hook still runs
    assert seen.read_text().splitlines() == ["", "set=0"], seen.read_text()
