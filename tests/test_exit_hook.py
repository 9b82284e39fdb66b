"""The on-exit hook (train.json `on_exit`, `nanopt train --on-exit`): a shell command run once, on rank 0, when the
run ends for any reason (completed, preempted, diverged, a user error, Ctrl-C, a crash), bounded by
`on_exit_timeout_s`, its output in on_exit.log; and whatever becomes of it never changes the run's exit status nor
what the run saved.

Training runs are real `nanopt train` processes forked from the warm launcher (tests/faulthelp.py); two ranks go
through the real torchrun launcher. The hooks are real shell commands that append what they saw to a file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run, tree_digest

from nanopt.errors import ConfigError
from nanopt.train import checkpoint as ckpt
from nanopt.train.guard.exit_hook import REASONS, ExitDetails, exit_reason, run_exit_hook

STOPPED_EARLY = 75  # nanopt's exit status for a run stopped by SIGTERM / SIGINT after saving (see README)
SEEN = ("$NANOPT_EXIT_REASON|$NANOPT_STEP|$NANOPT_TOTAL_STEPS|$NANOPT_EXIT_STATUS|$NANOPT_RUN_DIR|"
        "${NANOPT_EXIT_MESSAGE-none}|${RANK-none}|$(cat \"$NANOPT_RUN_DIR/checkpoints/latest\" 2>/dev/null)")


def recording_hook(out: Path) -> str:
    """A hook that appends one line of what it saw (the NANOPT_* variables, torchrun's RANK, the `latest` pointer)."""
    return f'echo "{SEEN}" >> {out}'


def seen(out: Path) -> list[dict[str, str]]:
    """Each time the hook ran, what it saw."""
    names = ("reason", "step", "total_steps", "status", "run_dir", "message", "rank", "latest")
    lines = out.read_text().splitlines() if out.exists() else []
    return [dict(zip(names, line.split("|"), strict=True)) for line in lines]


def hook_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "on-exit" in line]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def wait_for_step(run: Path, step: int, alive) -> None:
    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        try:
            lines = (run / "metrics.jsonl").read_text().splitlines()
            if any(json.loads(x).get("kind") == "train" and json.loads(x)["step"] >= step for x in lines if x):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.005)


@pytest.fixture(scope="module")
def done(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A complete 6-step run, trained without a hook: training it again only loads and checks it (fast)."""
    run = tiny_run(tmp_path_factory.mktemp("done"), tiny_dataset, "done", max_steps=6)
    launcher.train(run)
    return run


# ------------------------------------------------------------------------------------- the reasons, for real


def test_runs_once_after_a_completed_run_with_what_it_needs_to_know(tmp_path: Path, tiny_dataset: Path,
                                                                    launcher: Launcher):
    run, out = tiny_run(tmp_path, tiny_dataset, "run", max_steps=6), tmp_path / "hook.out"
    child = launcher.run("train", run, "--no-live", "--on-exit", recording_hook(out))
    assert child.status == 0, child.stderr[-3000:]
    assert seen(out) == [{"reason": "completed", "step": "6", "total_steps": "6", "status": "0",
                          "run_dir": str(run.absolute()), "message": "none", "rank": "none",
                          "latest": "step-000006"}]  # it ran after the last checkpoint was complete
    [line] = hook_lines(child.stderr)
    assert re.fullmatch(rf'on-exit: ".*" exited 0 after \d+\.\d s \(output in {re.escape(str(run))}/on_exit.log\)',
                        line), line
    log = (run / "on_exit.log").read_text()
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC nanopt train ended: completed \(exit status 0\); on_exit: "
                    "echo ", log), log
    assert "on_exit exited 0 after" in log.splitlines()[-1]


def test_sigterm_runs_it_with_reason_preempted_and_the_run_resumes(tmp_path: Path, tiny_dataset: Path,
                                                                   launcher: Launcher):
    run, out = tiny_run(tmp_path, tiny_dataset, "run", max_steps=20), tmp_path / "hook.out"
    child = launcher.start("train", run, "--no-live", "--on-exit", recording_hook(out))
    wait_for_step(run, 3, lambda: not launcher.finished(child))
    os.kill(child.pid, signal.SIGTERM)
    assert launcher.wait(child) == STOPPED_EARLY, child.stderr[-3000:]
    [hook] = seen(out)
    saved = ckpt.read_pointer(run / "checkpoints", "latest")
    assert hook["reason"] == "preempted" and hook["status"] == str(STOPPED_EARLY) and hook["total_steps"] == "20"
    assert saved == ckpt.step_dir_name(int(hook["step"])) == hook["latest"]  # the checkpoint it stopped at, saved
    resumed = launcher.train(run)  # train.json has no on_exit: nothing more runs
    assert f"resumed from {run / 'checkpoints' / saved}" in resumed.stderr
    assert ckpt.read_pointer(run / "checkpoints", "latest") == "step-000020" and len(seen(out)) == 1


def test_divergence_runs_it_with_reason_diverged_and_the_error_line_unchanged(tmp_path: Path, tiny_dataset: Path,
                                                                              launcher: Launcher):
    # A learning rate of 1e30 really diverges: the first step sends the weights to ~1e30, every later gradient is NaN.
    run, out = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, learning_rate=1e30), tmp_path / "hook.out"
    child = launcher.run("train", run, "--no-live", "--on-exit", recording_hook(out))
    assert child.status == 2, child.stderr[-3000:]
    [error] = errors(child.stderr)
    assert "training diverged" in error and "Traceback" not in child.stderr
    assert child.stderr.rstrip().splitlines()[-1] == error  # nanopt's one error line still ends the output
    [hook] = seen(out)
    assert (hook["reason"], hook["status"], hook["total_steps"]) == ("diverged", "2", "12")
    assert f"error: {hook['message']}" == error  # the same line the person reads


def test_a_train_json_that_cannot_be_loaded_still_runs_the_given_command(tmp_path: Path, tiny_dataset: Path,
                                                                         cli_in_process):
    run, out = tiny_run(tmp_path, tiny_dataset, "run"), tmp_path / "hook.out"
    (run / "train.json").write_text(json.dumps({**json.loads((run / "train.json").read_text()), "warmup": 3}))
    before = tree_digest(run)
    result = cli_in_process("train", run, "--no-live", "--on-exit", recording_hook(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [error] = errors(result.stderr)
    assert "train.json" in error and "unknown key 'warmup'" in error and "Hint: did you mean 'warmup_steps'" in error
    assert result.stderr.rstrip().splitlines()[-1] == error  # nanopt's one error line still ends the output
    [hook] = seen(out)
    assert (hook["reason"], hook["status"], hook["step"], hook["total_steps"]) == ("error", "2", "", "")
    assert f"error: {hook['message']}" == error
    assert len(hook_lines(result.stderr)) == 1
    assert {name: digest for name, digest in tree_digest(run).items() if name != "on_exit.log"} == before


def test_a_mistyped_run_directory_runs_the_command_but_creates_nothing(tmp_path: Path, cli_in_process):
    out, missing = tmp_path / "hook.out", tmp_path / "runs" / "dmeo"
    result = cli_in_process("train", missing, "--no-live", "--nproc-per-node", "2", "--on-exit", recording_hook(out))
    assert result.returncode == 2 and "run directory not found" in errors(result.stderr)[0]
    assert [hook["reason"] for hook in seen(out)] == ["error"]  # once, in the process that was to launch torchrun
    [line] = hook_lines(result.stderr)
    assert line.startswith("warning: on-exit") and "its output was not logged" in line
    assert not missing.exists() and not missing.parent.exists()


def test_a_second_training_refused_by_the_lock_does_not_run_it(done: Path, tmp_path: Path, cli_in_process):
    """The process holding the run runs the hook when it ends; a shutdown from the refused one would cut it short."""
    from nanopt.train.guard.lock import RunLock

    out, lock = tmp_path / "hook.out", RunLock(done)
    lock.acquire()
    try:
        result = cli_in_process("train", done, "--no-live", "--on-exit", recording_hook(out))
    finally:
        lock.release()
    assert_user_error(result, "is being trained")
    assert not out.exists()


# ------------------------------------------------------------------------- a hook that fails loses nothing


@pytest.mark.parametrize(("command", "said"), [
    ("echo failing; exit 3", 'on-exit: "echo failing; exit 3" exited 3 after'),
    ("nanopt-no-such-command --now", "exited 127 (command not found)"),
], ids=["exit-3", "missing-command"])
def test_a_failing_hook_is_one_warning_and_the_run_is_still_complete(done: Path, tmp_path: Path, launcher: Launcher,
                                                                     command: str, said: str):
    before = tree_digest(done / "checkpoints")
    child = launcher.run("train", done, "--no-live", "--on-exit", command, "--json")
    assert child.status == 0, child.stderr[-3000:]
    assert json.loads(child.stdout)["completed"]  # --json's stdout stays one JSON document
    [line] = hook_lines(child.stderr)
    assert line.startswith("warning: on-exit: ") and said in line, line
    assert tree_digest(done / "checkpoints") == before
    ckpt.verify(done / "checkpoints" / "step-000006")


def test_a_hook_past_its_timeout_is_killed_with_its_children_and_the_preempted_run_resumes(
        tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=20, on_exit_timeout_s=1)
    pids = tmp_path / "pids"
    hook = f"sleep 60 & echo $! >> {pids}; sh -c 'echo $$ >> {pids}; exec sleep 60'; echo never >> {pids}"
    child = launcher.start("train", run, "--no-live", "--on-exit", hook)
    wait_for_step(run, 3, lambda: not launcher.finished(child))
    os.kill(child.pid, signal.SIGTERM)
    assert launcher.wait(child, timeout=30) == STOPPED_EARLY, child.stderr[-3000:]
    [line] = hook_lines(child.stderr)
    assert "timed out after 1 s (on_exit_timeout_s) and was killed with every process it started" in line, line
    sleepers = [int(pid) for pid in pids.read_text().split()]
    assert len(sleepers) == 2  # the background and the foreground child; the shell never reached its last echo
    assert all(gone(pid) for pid in sleepers)
    resumed = launcher.train(run, "--on-exit", "true")
    assert "resumed from" in resumed.stderr and 'on-exit: "true" exited 0' in resumed.stderr
    assert ckpt.read_pointer(run / "checkpoints", "latest") == "step-000020"


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for init to reap it counts as ended)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_an_unwritable_log_still_runs_the_hook_and_says_so(done: Path, tmp_path: Path, launcher: Launcher):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.json", "train.json"):
        (run / name).write_bytes((done / name).read_bytes())
    (run / "on_exit.log").mkdir()  # a log that cannot be opened
    out = tmp_path / "hook.out"
    child = launcher.run("train", run, "--no-live", "--set", "max_steps=2", "--on-exit", recording_hook(out))
    assert child.status == 0, child.stderr[-3000:]
    assert [hook["reason"] for hook in seen(out)] == ["completed"]
    [line] = hook_lines(child.stderr)
    assert line.startswith("warning: on-exit: ") and "exited 0" in line and "its output was not logged" in line


# ------------------------------------------------------------------------------------------------ two ranks


@pytest.mark.slow  # three processes import torch: ~10-15 s on 2 busy cores
def test_under_two_ranks_it_runs_once_on_rank_0_and_torchrun_does_not_cut_it_short(tmp_path: Path,
                                                                                   tiny_dataset: Path,
                                                                                   launcher: Launcher):
    """Both ranks diverge together; rank 1 leaves at once and torchrun then stops rank 0, which is still running
    the hook (a second here): the hook still ends, logged, before nanopt exits, and runs only once."""
    run, out = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, learning_rate=1e30), tmp_path / "hook.out"
    child = launcher.run("train", run, "--no-live", "--nproc-per-node", "2", "--on-exit",
                         f"sleep 1; {recording_hook(out)}")
    assert child.status == 2, child.stderr[-3000:]
    [error] = errors(child.stderr)
    assert "training diverged" in error
    # Once; in a plain shell: no RANK of the ended run for a `nanopt eval` the hook might start.
    assert seen(out) == [{"reason": "diverged", "step": "", "total_steps": "12", "status": "2",
                          "run_dir": str(run.absolute()), "message": error.removeprefix("error: "), "rank": "none",
                          "latest": ""}]
    assert len(hook_lines(child.stderr)) == 1
    assert "on_exit exited 0 after" in (run / "on_exit.log").read_text().splitlines()[-1]


# ------------------------------------------------------------------------------------------ the library part


def test_the_reason_follows_how_train_ended():
    from nanopt.train.step import TrainingDiverged

    ends = {(None, True): "completed", (None, False): "preempted", (KeyboardInterrupt(), True): "interrupted",
            (TrainingDiverged("training diverged", "lower the learning rate"), True): "diverged",
            (ConfigError("train.json: bad", "fix it"), True): "error",
            (ZeroDivisionError("division by zero"), True): "crashed"}
    assert {exit_reason(error, completed) for error, completed in ends} == set(REASONS)
    assert all(exit_reason(error, completed) == reason for (error, completed), reason in ends.items())


def test_ctrl_c_while_the_hook_runs_stops_it_and_nothing_raises(tmp_path: Path):
    """The hook sends this process SIGINT (as a Ctrl-C would) and sleeps: run_exit_hook stops it and returns."""
    pid_file = tmp_path / "sleeper"
    # Python's own Ctrl-C handler, whatever the test runner or an earlier test left in place.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run_exit_hook(f"sh -c 'echo $$ > {pid_file}; exec sleep 60' & sleep 1; kill -INT {os.getpid()}; "
                               "wait", "completed", tmp_path, 30, ExitDetails(exit_status=0))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.stopped and not result.ok and result.seconds < 10
    assert "was stopped by Ctrl-C" in result.describe()
    assert gone(int(pid_file.read_text()))
