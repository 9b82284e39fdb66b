"""Checkpoints written in the background (nanopt.train.checkpoint.save): a kill while one is being written never leaves
`latest` on an incomplete checkpoint, and `checkpoint_async: false` makes every save wait for its files."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import psutil
from faulthelp import TINY_MODEL, Launcher
from trainhelp import losses, make_run

from nanopt.train import checkpoint as ckpt

# A checkpoint every step, so that a save is in flight most of the time; a model wide enough for it to take a while.
TRAIN = {"micro_batch_size": 1, "global_batch_tokens": 64, "max_steps": 6, "checkpoint_interval": 1,
         "keep_checkpoints": 3, "eval_interval": 0, "warmup_steps": 2}


def test_a_kill_during_a_background_save_leaves_latest_on_a_complete_checkpoint(tmp_path: Path, tiny_dataset: Path,
                                                                                 launcher: Launcher):
    """SIGKILL to the launcher and both ranks while a checkpoint is still being written (its `.tmp-step-N/` exists,
    after an earlier one completed): the `latest` pointer itself names a complete checkpoint, and the run resumes
    from it."""
    wider = {**TINY_MODEL, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4}
    run = make_run(tmp_path, tiny_dataset, "killed", model=wider, **TRAIN)
    job = launcher.start("train", run, "--no-live", "--nproc-per-node", "2")
    root, deadline = run / "checkpoints", time.monotonic() + 120
    while not (list(root.glob(".tmp-step-*")) and (root / "latest").exists()):
        assert not launcher.finished(job) and time.monotonic() < deadline, "the run ended before a save was caught"
        time.sleep(0.0005)
    for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived helper may end between list and kill
            process.kill()  # every process at once, as when the node is lost
    launcher.wait(job)
    named = ckpt.read_pointer(root, "latest")  # the pointer itself, not the fallback to the newest valid one
    found = ckpt.verify_discovered(root / named)  # every file present and matching its checksum
    assert found.layout == ckpt.SHARDED and found.step < TRAIN["max_steps"]
    resumed = launcher.train(run, "--nproc-per-node", "2")
    assert f"resumed from {found.path}" in resumed.stderr
    assert sorted(losses(run)) == list(range(1, TRAIN["max_steps"] + 1))


def test_checkpoint_async_false_makes_every_save_wait_for_its_files(tmp_path: Path, tiny_dataset: Path,
                                                                    cli_in_process):
    run = make_run(tmp_path, tiny_dataset, "waits", model=TINY_MODEL,
                   **{**TRAIN, "max_steps": 4, "checkpoint_interval": 2, "checkpoint_async": False})
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 4]
    assert all(r["blocked_s"] == r["write_s"] > 0 for r in saves), saves
    # One process's writer thread says the CPU it used: some, and no more than the save's wall time.
    assert all(0 < r["writer_cpu_s"] <= r["write_s"] for r in saves), saves


def test_on_a_cpu_a_background_writes_cpu_time_is_charged_to_checkpoints_not_steps(tmp_path: Path,
                                                                                   tiny_dataset: Path, cli_in_process):
    """The writer thread runs on the cores the steps use, so its CPU seconds are time the steps lost to
    checkpoints: the session's checkpoint phase holds them as well as the time each save blocked."""
    run = make_run(tmp_path, tiny_dataset, "charged", model=TINY_MODEL, **TRAIN)
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r.get("event") == "checkpoint"]
    assert len(saves) == TRAIN["max_steps"] and all(r["writer_cpu_s"] > 0 for r in saves), saves
    charged = [r for r in records if r.get("kind") == "phases"][-1]["seconds"]["checkpoint"]
    assert charged >= sum(r["blocked_s"] + r["writer_cpu_s"] for r in saves) - 1e-3, (charged, saves)


def test_a_torch_whose_stager_closes_itself_after_each_save_still_saves_every_checkpoint(
        tmp_path: Path, tiny_dataset: Path, cli_in_process, monkeypatch):
    """torch 2.11's DefaultStager closes its copier at the end of every stage (pytorch/pytorch#183413), so a stager
    kept between saves fails the second with `KeyError: <class 'type'>`: the first H100 run died at its second
    checkpoint. The stager below behaves as 2.11's does; nanopt must notice and give each save its own copy."""
    from torch.distributed.checkpoint import staging

    class ClosesAfterStaging(staging.DefaultStager):  # what torch 2.11's _stage ends with
        def _stage(self, state_dict, **kwargs):
            try:
                return super()._stage(state_dict, **kwargs)
            finally:
                self._state_dict_stager.close()

    monkeypatch.setattr(staging, "DefaultStager", ClosesAfterStaging)
    run = make_run(tmp_path, tiny_dataset, "closing", model=TINY_MODEL, **{**TRAIN, "checkpoint_interval": 2})
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "checkpoint"] == [2, 4, 6]
    assert ckpt.verify_discovered(run / "checkpoints" / ckpt.read_pointer(run / "checkpoints", "latest")).step == 6
