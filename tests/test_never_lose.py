"""Ways an adversarial user lost work, each reproduced through the real `nanopt train`: a fresh start whose
checkpoints an older run's shadowed, step numbers past 999,999, links and renamed directories among the
checkpoints, malformed checkpoint metadata, a validation split too small for evaluation, two trainings of one run,
and a full disk while resuming.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from faulthelp import Launcher, tiny_run, tree_digest
from trainhelp import HIDE_CUDA, losses, make_run, write_tiny_checkpoint

from nanopt.rundir import temporary
from nanopt.train import checkpoint as ckpt

STOPPED_EARLY = 75


def write(run: Path, step: int) -> Path:
    return write_tiny_checkpoint(run, step)


def checkpoint_steps(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in ckpt.complete_checkpoints(run)]


# ------------------------------------------------------------------------------------------ item 3: ordering


def test_steps_past_999999_order_by_number_for_resume_and_retention(tmp_path: Path):
    for step in (999_990, 999_995, 1_000_000):
        write(tmp_path, step)
    found, skipped = ckpt.newest_valid(tmp_path)
    assert found.step == 1_000_000 and not skipped
    assert ckpt.resolve(tmp_path, "latest").step == 1_000_000
    ckpt.apply_retention(tmp_path, keep=2)
    assert checkpoint_steps(tmp_path) == [999_995, 1_000_000]  # the oldest went, never the newest


# ------------------------------------------------------------------------- item 4: links and renamed copies


def test_a_linked_or_renamed_step_directory_is_never_taken_for_the_newest(tmp_path: Path):
    run, elsewhere = tmp_path / "run", tmp_path / "other"
    write(run, 10)
    write(run, 20)
    far = write(elsewhere, 90)
    (run / "checkpoints" / "step-000099").symlink_to(far, target_is_directory=True)
    shutil.copytree(run / "checkpoints" / "step-000010", run / "checkpoints" / "step-000050")
    (run / "checkpoints" / "latest").unlink()  # no pointer: the search by step number must skip both
    found, skipped = ckpt.newest_valid(run)
    assert found.step == 20
    assert any("symbolic link" in note for note in skipped)
    assert any("says step 10" in note for note in skipped)


def test_a_complete_run_with_a_renamed_old_checkpoint_does_not_roll_back(tmp_path: Path, tiny_dataset: Path,
                                                                         launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=8, checkpoint_interval=4, eval_interval=0)
    launcher.train(run)
    before = losses(run)
    shutil.copytree(run / "checkpoints" / "step-000004", run / "checkpoints" / "step-000099")
    child = launcher.train(run)
    assert "already complete" in child.stderr
    assert losses(run) == before


# ------------------------------------------------------------------ item 10: malformed checkpoint metadata


def _break_meta(step_dir: Path, damage: str) -> None:
    meta_path = step_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    if damage == "not_an_object":
        meta = [meta]
    elif damage == "no_files":
        del meta["files"]
    elif damage == "tokens_a_string":
        meta["tokens"] = "many"
    elif damage == "ranks_a_number":
        meta["ranks"] = 5
    elif damage == "weights_not_safetensors":
        weights = step_dir / "model.safetensors"
        weights.write_bytes(b"\x00" * 64)
        meta["files"]["model.safetensors"] = ckpt.sha256(weights)  # the checksum agrees: only the format is wrong
    meta_path.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", ["not_an_object", "no_files", "tokens_a_string", "ranks_a_number",
                                    "weights_not_safetensors"])
def test_malformed_checkpoint_metadata_falls_back_to_the_previous_checkpoint(tmp_path: Path, damage: str):
    write(tmp_path, 10)
    newest = write(tmp_path, 20)
    _break_meta(newest, damage)
    found, skipped = ckpt.latest(tmp_path)
    assert found.step == 10
    assert len(skipped) == 1 and str(newest) in skipped[0]


def test_train_resumes_past_a_checkpoint_with_malformed_metadata(tmp_path: Path, tiny_dataset: Path,
                                                                 launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, checkpoint_interval=4, eval_interval=0)
    launcher.train(run, "--set", "max_steps=8")  # a shorter first session: checkpoints 4 and 8
    _break_meta(run / "checkpoints" / "step-000008", "tokens_a_string")
    child = launcher.train(run, "--allow-changed")
    assert "skipping a damaged checkpoint" in child.stderr and "resumed from" in child.stderr
    assert "step-000004" in child.stderr


# ----------------------------------------------------------------------- item 2: a fresh start, then a crash


def test_a_fresh_start_moves_the_old_run_aside_and_resume_follows_latest(tmp_path: Path, tiny_dataset: Path,
                                                                         launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=40, checkpoint_interval=2, eval_interval=0)
    launcher.train(run)  # the old run: checkpoints 36, 38, 40
    old_checkpoints = tree_digest(run / "checkpoints")
    fresh = launcher.train(run, "--resume", "none", "--set", "max_steps=10", "--allow-changed")
    assert "moved to" in fresh.stderr
    (aside,) = (run / "previous").iterdir()
    assert tree_digest(aside / "checkpoints") == old_checkpoints  # nothing of the old run is lost
    assert checkpoint_steps(run) == [6, 8, 10]  # and none of it is left among this run's checkpoints
    again = launcher.train(run, "--set", "max_steps=10", "--allow-changed")
    assert "already complete (10 steps)" in again.stderr
    assert sorted(losses(run)) == list(range(1, 11))  # metrics.jsonl holds this run only


def test_auto_resume_follows_the_latest_pointer(tmp_path: Path):
    write(tmp_path, 10)
    write(tmp_path, 20)
    ckpt.write_pointer(tmp_path / "checkpoints", "latest", "step-000010")
    found, notes = ckpt.latest(tmp_path)
    assert found.step == 10 and not notes
    ckpt.write_pointer(tmp_path / "checkpoints", "latest", "step-000030")  # names nothing: the newest valid one
    found, notes = ckpt.latest(tmp_path)
    assert found.step == 20 and "step-000030" in notes[0]


# --------------------------------------------------------------- item 5: a validation split too small to use


def test_a_validation_split_too_small_fails_at_setup_before_any_step(tmp_path: Path, tiny_dataset: Path,
                                                                     launcher: Launcher):
    # ~14k validation tokens hold not one window of seq_len 16,384 + 1; the ~108k training tokens do.
    run = make_run(tmp_path, tiny_dataset, "run", model={"max_position_embeddings": 16_384}, micro_batch_size=1,
                   global_batch_tokens=16_384, max_steps=4, eval_interval=2, checkpoint_interval=2)
    before = tree_digest(run)
    child = launcher.run("train", run, "--no-live")
    assert child.status == 2
    assert "split 'val'" in child.stderr and "fewer than one window" in child.stderr and "Traceback" not in child.stderr
    assert tree_digest(run) == before  # no step was run and so none was lost


# ---------------------------------------------------------------------- item 6: one training per run at once


def test_a_second_training_of_the_same_run_refuses_and_a_killed_one_leaves_no_stale_lock(
        tmp_path: Path, tiny_dataset: Path, launcher: Launcher, cli_in_process):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=1600, checkpoint_interval=1000, eval_interval=0)
    first = launcher.start("train", run, "--no-live")
    deadline = time.monotonic() + 60
    while len(_steps(run)) < 3:
        assert time.monotonic() < deadline and not launcher.finished(first), first.stderr[-2000:]
        time.sleep(0.05)
    second = cli_in_process("train", run, "--no-live")  # this test's process: the launcher runs one at a time
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"is being trained by pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
    os.kill(first.pid, signal.SIGKILL)
    launcher.wait(first)
    third = launcher.run("train", run, "--no-live", "--set", "max_steps=20", "--allow-changed")
    assert third.status == 0, third.stderr[-2000:]
    assert not (run / ".lock").exists()


def _steps(run: Path) -> list[int]:
    try:
        return sorted(losses(run))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


# --------------------------------------------------------------------------- item 11: a full disk at resume


def test_a_full_disk_at_resume_is_one_line_and_a_complete_run_needs_no_disk(tmp_path: Path, tiny_dataset: Path,
                                                                            launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, checkpoint_interval=4, eval_interval=0)
    launcher.train(run, "--set", "max_steps=8")
    with open(run / "metrics.jsonl", "a") as f:  # a session killed after its last checkpoint logged more steps
        f.write(json.dumps({"kind": "train", "step": 9, "tokens": 0, "loss": 1.0}) + "\n")
    before = tree_digest(run / "checkpoints")
    size = (run / "metrics.jsonl").stat().st_size
    full = launcher.run("train", run, "--no-live", "--allow-changed", fsize=size // 2)  # cannot rewrite metrics
    assert full.status == 2, full.stderr[-2000:]
    assert full.stderr.count("error:") == 1 and "Traceback" not in full.stderr
    assert "while setting up" in full.stderr
    assert tree_digest(run / "checkpoints") == before
    assert (run / "metrics.jsonl").stat().st_size == size and not temporary(run / "metrics.jsonl").exists()
    launcher.train(run, "--allow-changed")  # with room again it finishes
    # No file may grow past metrics.jsonl's size (the command's own stdout and stderr files fit below it).
    complete = launcher.run("train", run, "--no-live", fsize=(run / "metrics.jsonl").stat().st_size)
    assert complete.status == 0, complete.stderr[-2000:]
    assert "already complete" in complete.stderr


# ------------------------------------------------------------- item 17: an error one rank meets is its own to say


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_an_error_only_one_node_meets_is_printed_with_its_rank(tmp_path: Path, tiny_dataset: Path,
                                                                launcher: Launcher):
    """Two nodes on this machine, each started by its own `nanopt train --nnodes 2` on its own copy of the run
    directory, as on two machines; the second node lacks the dataset, a mistake only that node's rank meets. Node
    0's process is forked from the warm launcher, node 1's is a fresh `python -m nanopt`: both at once."""
    import subprocess
    import sys

    from clihelp import REPO

    runs = []
    for node in ("node0", "node1"):
        run = tiny_run(tmp_path / node, tiny_dataset, "run", max_steps=8, eval_interval=0)
        train = json.loads((run / "train.json").read_text())
        (run / "train.json").write_text(json.dumps({**train, "data": str(tmp_path / node / "data")}))
        runs.append(run)
    shutil.copytree(tiny_dataset, tmp_path / "node0" / "data")
    port = _free_port()
    env = {"PYTHONPATH": str(REPO), "COLUMNS": "200", "OMP_NUM_THREADS": "1", "NANOPT_PG_TIMEOUT_S": "5"}

    def node_argv(rank: int) -> list[str]:
        return ["train", str(runs[rank]), "--no-live", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node",
                "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]

    node0 = launcher.start(*node_argv(0), env=env)
    node1 = subprocess.Popen([sys.executable, "-m", "nanopt", *node_argv(1)], cwd=REPO,
                             env={**os.environ, **HIDE_CUDA, **env},  # CPU ranks, as the launcher's node 0
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err1 = node1.communicate(timeout=180)
    launcher.wait(node0, timeout=180)
    err0 = node0.stderr
    assert node1.returncode == 2, err1[-3000:]
    assert f"error: rank 1: {tmp_path / 'node1' / 'data'}" in err1 and "Traceback" not in err1
    assert node0.status != 0 and "Traceback" not in err0
    assert "error: rank 0 lost contact" in err0
