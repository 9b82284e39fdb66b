"""Resuming on another number of ranks is one command (an elastic restart on fewer GPUs needs no person): a micro-batch
the new world size cannot take is lowered by the session itself and said, and a micro-batch that differs from the
checkpoint's because the world size changed needs no --allow-changed. A fresh run keeps the one-line error that says
which numbers work.

Real processes: the first session on one process, the next on two gloo ranks under torchrun, then one again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import TINY_MODEL, Launcher
from trainhelp import losses, make_run

from nanopt.train import checkpoint as ckpt

# seq_len 16, 64 tokens a step: 4 sequences. One process at micro-batch 4 is accumulation 1; on two ranks 4 x 2 is
# past the step's 4 sequences, so that session must use 2.
TRAIN = {"micro_batch_size": 4, "global_batch_tokens": 64, "max_steps": 4, "checkpoint_interval": 2,
         "eval_interval": 0, "warmup_steps": 1, "lr_schedule": "constant"}


@pytest.mark.slow
def test_resume_on_more_ranks_lowers_the_micro_batch_in_one_command(tmp_path: Path, tiny_dataset: Path,
                                                                   launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **TRAIN)
    first = launcher.start("train", run, "--no-live", kill_at_step={
        "step": 3, "checkpoints": str(run / "checkpoints"), "latest": "step-000002"})
    assert launcher.wait(first) != 0 and ckpt.resolve(run, "latest").step == 2  # SIGKILLed after step 2's save

    two = launcher.train(run, "--nproc-per-node", "2")  # the same command on two ranks: no edit, no --allow-changed
    said = two.stdout + two.stderr
    assert "micro_batch_size 4 does not divide the global batch of 64 tokens on 2 rank(s)" in said, said[-3000:]
    assert "this session uses 2 (accumulation 1)" in said
    latest = ckpt.resolve(run, "latest")
    assert latest.step == 4 and latest.meta["world_size"] == 2
    assert latest.meta["config"]["train"]["micro_batch_size"] == 2
    assert json.loads((run / "train.json").read_text())["micro_batch_size"] == 4  # the file is unchanged
    assert set(losses(run)) == {1, 2, 3, 4}

    back = launcher.train(run)  # one process takes 4 again, and the checkpoint's 2 needs no --allow-changed
    assert "does not divide" not in back.stdout + back.stderr
    assert ckpt.resolve(run, "latest").step == 4


def test_a_fresh_run_the_world_size_cannot_take_is_still_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **TRAIN)
    result = cli_in_process("train", run, "--nproc-per-node", "2")
    assert_user_error(result, "global_batch_tokens", "micro_batch_size x seq_len x world_size = 4 x 16 x 2")
    assert not (run / "checkpoints").exists()


def test_the_micro_batch_is_free_when_the_world_size_changed_and_not_otherwise():
    from nanopt.config import ModelConfig, RunConfig, TrainConfig
    from nanopt.errors import ResumeError
    from nanopt.train.checkpoint.resume import check_resumable

    model = ModelConfig(**{"architecture": "llama", "vocab_size": 64, **TINY_MODEL})
    run = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(data="d", **{**TRAIN, "micro_batch_size": 2}))
    saved = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(data="d", **TRAIN)).snapshot()
    meta = {"config": saved, "world_size": 1, "data_fingerprint": "f"}
    check_resumable(meta, run, "f", allow_changed=False, world_size=2)
    with pytest.raises(ResumeError, match="micro_batch_size"):
        check_resumable(meta, run, "f", allow_changed=False, world_size=1)
