"""Outcomes that were wrong or silent, each reproduced through the real CLI with real files and processes: a full
disk at resume, a rank that crashes under the launcher, a damaged `latest` under eval and export, eval while the
run trains, strangers among the step directories, a checkpoint of another run, a full disk under a sharded
background save, an on-exit command that floods its log, and a rendezvous endpoint nobody listens on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from clihelp import REPO
from faulthelp import Launcher, tiny_run, tree_digest

PLANTED_CRASH = REPO / "tests" / "planted_crash"  # a sitecustomize that makes one rank raise (test-only)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A run stopped at step 8 of 12, checkpoints every 4 steps, no in-loop evaluation."""
    run = tiny_run(tmp_path_factory.mktemp("trained"), tiny_dataset, "run", max_steps=12, checkpoint_interval=4,
                   eval_interval=0)
    launcher.train(run, "--set", "max_steps=8")
    return run


def copy_of(run: Path, dest: Path) -> Path:
    return shutil.copytree(run, dest / run.name, symlinks=True)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# -------------------------------------------------------------------------------------- a full disk at resume


def test_a_full_disk_at_resume_never_leaves_a_torn_line_in_metrics(tmp_path: Path, trained: Path,
                                                                    launcher: Launcher):
    """Room for part of the resume event only: the line is written whole or not at all."""
    run = copy_of(trained, tmp_path)
    metrics = (run / "metrics.jsonl").read_bytes()
    before = tree_digest(run / "checkpoints")
    full = launcher.run("train", run, "--no-live", "--allow-changed", fsize=len(metrics) + 20)
    assert full.status == 2, full.stderr[-3000:]
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert tree_digest(run / "checkpoints") == before
    [line] = error_lines(full.stderr)
    assert "Traceback" not in full.stderr
    assert f"could not write {run / 'metrics.jsonl'} while setting up: File too large" in line


def test_a_disk_too_full_for_the_lock_holder_line_is_still_one_line(tmp_path: Path, trained: Path,
                                                                     launcher: Launcher):
    """40 bytes: not even the lock file's holder line fits, whose failed write came back as a traceback when the
    lock was released. stderr itself is a file under the same limit, so only its start can be read."""
    run = copy_of(trained, tmp_path)
    metrics = (run / "metrics.jsonl").read_bytes()
    full = launcher.run("train", run, "--no-live", "--allow-changed", fsize=40)
    assert full.status == 2, full.stderr
    assert full.stderr.startswith("error: could not write")
    assert (run / "metrics.jsonl").read_bytes() == metrics and not (run / ".lock").exists()


# ------------------------------------------------------------------------------ a rank that raises (a bug)


@pytest.mark.parametrize("restarts", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_crashed_rank_is_named_with_its_error_and_exit_1(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                                           restarts: int):
    """Rank 1 raises a RuntimeError in its 5th step (planted by a test-only sitecustomize): the job exits 1 with one
    line naming rank 1 and its error, not rank 0's lost contact; each restart line says rank 1 crashed; rank 0's
    on-exit command hears `crashed` and status 1."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=20, checkpoint_interval=2)
    on_exit = 'echo "$NANOPT_EXIT_REASON $NANOPT_EXIT_STATUS $NANOPT_EXIT_MESSAGE"'
    env = {"PYTHONPATH": f"{REPO}:{PLANTED_CRASH}", "PLANTED_CRASH_RANK": "1", "PLANTED_CRASH_STEP": "5"}
    job = launcher.run("train", run, "--no-live", "--nproc-per-node", "2", "--max-restarts", restarts,
                       "--on-exit", on_exit, env=env)
    assert job.status == 1, job.stderr[-3000:]
    [line] = error_lines(job.stderr)
    assert line.startswith("error: rank 1: crashed with RuntimeError: planted crash in rank 1"), line
    assert "lost contact" not in job.stderr
    restarted = [text for text in job.stderr.splitlines() if text.startswith("restart ")]
    assert len(restarted) == restarts
    assert all("rank 1 (pid " in text and "crashed with RuntimeError: planted crash" in text for text in restarted)
    assert "killed by SIGTERM" not in job.stderr
    hook = (run / "on_exit.log").read_text()
    assert hook.count("crashed 1 rank 1 crashed with RuntimeError: planted crash in rank 1") == 1, hook
