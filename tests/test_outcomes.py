"""Outcomes that were wrong or silent, each reproduced through the real CLI with real files and processes: a full
disk at resume, a rank that crashes under the launcher, a damaged `latest` under eval and export, eval while the
run trains, strangers among the step directories, a checkpoint of another run, a full disk under a sharded
background save, an on-exit command that floods its log, and a rendezvous endpoint nobody listens on.
"""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from clihelp import REPO
from faulthelp import HANG_GUARD_S, Launcher, tiny_run, tree_digest

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


@pytest.mark.parametrize("rank, restarts", [(1, 0), pytest.param(0, 0, marks=pytest.mark.slow),
                                           pytest.param(1, 1, marks=pytest.mark.slow)])
def test_a_crashed_rank_is_named_with_its_error_and_exit_1(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                                           rank: int, restarts: int):
    """One rank raises a RuntimeError in its 5th step (planted by a test-only sitecustomize): the job exits 1 with one
    line naming that rank and its error, not the other's lost contact; each restart line says the rank crashed;
    rank 0's on-exit command hears `crashed` and status 1, once."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=20, checkpoint_interval=2)
    on_exit = 'echo "$NANOPT_EXIT_REASON $NANOPT_EXIT_STATUS $NANOPT_EXIT_MESSAGE"'
    env = {"PYTHONPATH": f"{REPO}:{PLANTED_CRASH}", "PLANTED_CRASH_RANK": str(rank), "PLANTED_CRASH_STEP": "5"}
    job = launcher.run("train", run, "--no-live", "--nproc-per-node", "2", "--max-restarts", restarts,
                       "--on-exit", on_exit, env=env)
    assert job.status == 1, job.stderr[-3000:]
    crash = f"crashed with RuntimeError: planted crash in rank {rank}"
    [line] = error_lines(job.stderr)
    assert line.startswith(f"error: rank {rank}: {crash} (the traceback is above). Hint: a bug"), line
    assert "lost contact" not in job.stderr
    restarted = [text for text in job.stderr.splitlines() if text.startswith("restart ")]
    assert len(restarted) == restarts
    assert all(f"after rank {rank} (pid " in text and crash in text for text in restarted)
    assert "killed by SIGTERM" not in job.stderr
    assert (run / "on_exit.log").is_file(), job.stderr[-3000:]  # rank 0 ran its hook: what it said if not
    hook = (run / "on_exit.log").read_text()
    said = f"crashed 1 rank 1 {crash}" if rank else "crashed 1 RuntimeError: planted crash in rank 0"
    assert hook.count(said) == 1 and hook.count("nanopt train ended:") == 1, hook


# ---------------------------------------------------------------------- eval and export with a damaged `latest`


def damage_weights(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit in the middle of the tensor data
    weights.write_bytes(bytes(data))


def test_eval_says_which_checkpoint_it_used_when_latest_is_damaged(tmp_path: Path, trained: Path,
                                                                   launcher: Launcher):
    run = copy_of(trained, tmp_path)
    damage_weights(run / "checkpoints" / "step-000008")
    result = launcher.run("eval", run, "--no-samples", "--json")
    assert result.status == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["step"] == 4
    [note] = out["notes"]
    assert note.startswith("using step-000004, not the newest checkpoint: 'latest' names step-000008, which cannot "
                           "be used") and "checksum mismatch" in note
    assert f"note: {run}: {note}" in " ".join(result.stderr.split())
    assert json.loads((run / "eval.json").read_text())["notes"] == [note]  # the record says so too


def test_export_refuses_to_ship_an_older_checkpoint_in_place_of_a_damaged_latest(tmp_path: Path, trained: Path,
                                                                                launcher: Launcher):
    run = copy_of(trained, tmp_path)
    damage_weights(run / "checkpoints" / "step-000008")
    for args in ((), ("--checkpoint", "latest")):
        refused = launcher.run("export", run, "--out", tmp_path / "hf", *args)
        assert refused.status == 2, refused.stderr[-3000:]
        [line] = [text for text in refused.stderr.splitlines() if text.strip()]
        assert "'latest' names step-000008, which cannot be used" in line, line
        assert "not exporting the older step-000004 in its place" in line
        assert "Hint: to export step-000004, name it: --checkpoint step-000004" in line
        assert not (tmp_path / "hf").exists()
    named = launcher.run("export", run, "--out", tmp_path / "hf", "--checkpoint", "step-000004", "--json")
    assert named.status == 0, named.stderr[-3000:]
    assert json.loads(named.stdout)["step"] == 4


# ----------------------------------------------------------------------------- eval while the run trains


@pytest.mark.slow
def test_eval_keeps_its_result_when_training_removes_the_checkpoint_it_scores(tmp_path: Path, tiny_dataset: Path,
                                                                              launcher: Launcher):
    """`nanopt eval RUN` scores step-000008 while `nanopt train RUN` goes on and its retention (keep_checkpoints 1)
    deletes step-000008. The eval is held (SIGSTOP) once its progress bar shows, i.e. with the weights read, while
    the training saves step-000012 and deletes step-000008; then it goes on. The result is kept in RUN/eval.json,
    and a note says what happened (before: exit 2, nothing kept, and a hint to make the run directory writable)."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, checkpoint_interval=4, eval_interval=0,
                   keep_checkpoints=1)
    launcher.train(run, "--set", "max_steps=8")
    # stderr on a terminal, so that the progress bar (shown once the loss is being measured) tells when to hold it
    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    evaluation = subprocess.Popen([sys.executable, "-m", "nanopt", "eval", run, "--tokens", "all",
                                   "--micro-batch-size", "1", "--no-samples", "--json"], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    shown = bytearray()
    threading.Thread(target=_drain, args=(leader, shown), daemon=True).start()
    deadline = time.monotonic() + HANG_GUARD_S
    while b"eval " not in shown and evaluation.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    held = psutil.Process(evaluation.pid)
    held.suspend()
    try:
        assert evaluation.poll() is None, shown.decode(errors="replace")
        launcher.train(run, "--allow-changed")  # steps 9-12: saves step-000012, deletes step-000008
        assert not (run / "checkpoints" / "step-000008").exists()
    finally:
        held.resume()
    out, _ = evaluation.communicate(timeout=HANG_GUARD_S)
    stderr = shown.decode(errors="replace")
    assert evaluation.returncode == 0, stderr[-3000:]
    result = json.loads(out)
    assert result["step"] == 8 and result["test_loss"] > 0
    [note] = result["notes"]
    assert note.startswith("step-000008 was removed while it was evaluated (a `nanopt train` of this run keeps only "
                           "its newest 1 checkpoint(s)") and note.endswith(f"kept in {run / 'eval.json'} only")
    assert json.loads((run / "eval.json").read_text())["test_loss"] == result["test_loss"]
    assert "note:" in stderr and "writable" not in stderr


def _drain(fd: int, into: bytearray) -> None:
    """Read a terminal's output until its last writer closes it."""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the process on the other side has ended
            return
        if not chunk:
            return
        into.extend(chunk)


# ------------------------------------------------------------------------------ a checkpoint of another run


def test_eval_of_another_runs_checkpoint_is_refused_and_writes_nothing(tmp_path: Path, trained: Path,
                                                                      launcher: Launcher):
    mine, other = copy_of(trained, tmp_path / "mine"), copy_of(trained, tmp_path / "other")
    before = tree_digest(tmp_path)
    theirs = other / "checkpoints" / "step-000008"
    refused = launcher.run("eval", mine, "--checkpoint", theirs, "--no-samples")
    assert refused.status == 2, refused.stderr[-3000:]
    [line] = [text for text in refused.stderr.splitlines() if text.strip()]
    assert f"{theirs} is a checkpoint of the run {other}, not of {mine}" in line
    assert f"Hint: evaluate it as its own run's: nanopt eval {other} --checkpoint step-000008" in line
    assert tree_digest(tmp_path) == before  # no eval.json in either run
    done = launcher.run("eval", other, "--checkpoint", "step-000008", "--no-samples")  # as the hint says
    assert done.status == 0 and (theirs / "eval.json").is_file() and not (mine / "eval.json").exists()


# ------------------------------------------------------------------------- strangers among the step directories


def test_a_foreign_or_misnamed_step_directory_takes_no_retention_slot_and_is_never_deleted(
        tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    """keep_checkpoints 2, with a copy of step-000002 renamed step-000099 (newer by name than any real one) and a
    foreign step-000001 (its meta.json is not nanopt's): retention keeps the two newest real checkpoints and leaves
    both strangers as they are (before: step-000099 held a slot for good, and step-000001 was deleted)."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=10, checkpoint_interval=2, keep_checkpoints=2,
                   eval_interval=0)
    launcher.train(run, "--set", "max_steps=4")
    root = run / "checkpoints"
    shutil.copytree(root / "step-000002", root / "step-000099")
    (root / "step-000001").mkdir()
    (root / "step-000001" / "meta.json").write_text(json.dumps({"made_by": "someone else"}))
    strangers = {name: tree_digest(root / name) for name in ("step-000001", "step-000099")}
    launcher.train(run, "--allow-changed")
    real = sorted(p.name for p in root.glob("step-*") if p.name not in strangers)
    assert real == ["step-000008", "step-000010"]
    assert {name: tree_digest(root / name) for name in strangers} == strangers


# ------------------------------------------------------------------------------ an on-exit command that floods


def test_an_on_exit_command_that_floods_its_output_cannot_fill_the_disk(tmp_path: Path, trained: Path,
                                                                      launcher: Launcher):
    from nanopt.train.guard.exit_hook import LOG_CAP_BYTES

    run = copy_of(trained, tmp_path)
    printed = 3 * LOG_CAP_BYTES + 12_345
    launcher.train(run, "--allow-changed", "--on-exit", f"yes nanopt-on-exit | head -c {printed}")
    log = (run / "on_exit.log").read_bytes()
    assert len(log) < LOG_CAP_BYTES + 1000  # the header, the first LOG_CAP_BYTES, the note and the footer
    assert log.count(b"nanopt-on-exit\n") == LOG_CAP_BYTES // len(b"nanopt-on-exit\n")
    dropped = printed - LOG_CAP_BYTES
    assert f"[nanopt: {dropped} more bytes of output dropped; on_exit.log keeps the first {LOG_CAP_BYTES} bytes of " \
           "each run]".encode() in log
    assert b" on_exit exited 0 after " in log.splitlines()[-1]  # the footer comes last


# ------------------------------------------------------------------------ a rendezvous nobody can be reached at


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # a cold `python -m nanopt`: the warm launcher's torch was imported with its C++ log on
def test_an_unreachable_rendezvous_endpoint_is_one_line_in_bounded_time(tmp_path: Path, tiny_dataset: Path):
    """Node 1 of 2 given an endpoint where nobody listens (a closed port on this machine; PET_RDZV_CONF's is_host=0
    makes torchrun treat it as another machine's, read_timeout=2 shortens torchrun's 60 s wait): one line, exit 1,
    within the wait, nothing written into the run."""
    from clihelp import run_cli

    run = tiny_run(tmp_path, tiny_dataset, "run")
    before = tree_digest(run)
    endpoint = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    result = run_cli("train", run, "--no-live", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                     env={"PET_RDZV_CONF": "is_host=0,read_timeout=2", "CUDA_VISIBLE_DEVICES": ""})
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [text for text in result.stderr.splitlines() if text.strip()]
    assert line.startswith(f"error: --nnodes 2: could not reach the rendezvous at {endpoint} (gave up after "), line
    assert "Hint: start the first node (--node-rank 0) too" in line
    assert tree_digest(run) == before


# ------------------------------------------------------------------ a full disk under a sharded background save


@pytest.mark.slow  # two cold torchrun workers
def test_a_full_disk_during_a_sharded_background_save_is_one_line_and_the_run_resumes(tmp_path: Path, trained: Path,
                                                                                     launcher: Launcher):
    """Two ranks resume the run at step 8 under a 30 kB file-size limit: room for metrics.jsonl, not for the shards
    DCP writes in the background for step 12. The failure comes out at the end as one line, exit 2, `latest` stays
    on step-000008 with every checkpoint as it was, and the run then resumes from it and finishes (before: DCP's
    CheckpointException, a BaseException, escaped as a traceback of every rank and 'rank N exited with 1')."""
    run = copy_of(trained, tmp_path)
    before = tree_digest(run / "checkpoints")
    full = launcher.run("train", run, "--no-live", "--nproc-per-node", "2", "--allow-changed", fsize=30_000)
    assert full.status == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    [line] = error_lines(full.stderr)
    assert line == ("error: could not write checkpoint step-000012: File too large. Hint: free disk space or fix "
                    "permissions; earlier checkpoints and 'latest' are intact"), line
    assert tree_digest(run / "checkpoints") == before  # latest still names step-000008; nothing half-written
    resumed = launcher.train(run, "--allow-changed")
    assert "resumed from" in resumed.stderr and "step-000008" in resumed.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000012"
