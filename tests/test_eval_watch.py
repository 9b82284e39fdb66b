"""`nanopt eval RUN --watch`: every checkpoint scored once, in order, beside a real training; holds that keep a
checkpoint from retention until released (in-process, deterministically); a restarted watcher skipping what it
scored; a holder paused and killed (or its staged file removed) at each step of taking its hold; nothing written
into checkpoints/; links refused where the watcher writes."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from clihelp import REPO, assert_user_error
from faulthelp import Launcher, tiny_run, tree_digest
from taskdata import write_task_data
from trainhelp import HIDE_CUDA, write_tiny_checkpoint

from nanopt.errors import WritePathError
from nanopt.evaluate.history import read_history
from nanopt.evaluate.report import EvalOptions
from nanopt.evaluate.watch import WatchEvents, watch_run
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint.hold import HOLD_TTL_S, Hold, hold_is_live, is_held, remove_stale_holds, still_there
from nanopt.train.checkpoint.write import remove_step_dir

WATCH = ("--watch", "--poll", "0.05", "--device", "cpu", "--no-samples", "--tokens", "512")


def names(run: Path) -> list[str]:
    return [p.name for p in ckpt.complete_checkpoints(run)]


# ------------------------------------------------------------------------------------------- holds, in-process


def test_retention_keeping_one_spares_a_held_checkpoint_until_it_is_released(tmp_path: Path):
    for step in (10, 20, 30):
        write_tiny_checkpoint(tmp_path, step)
    with Hold(tmp_path, "step-000010"):
        assert is_held(tmp_path, "step-000010") and not is_held(tmp_path, "step-000020")
        ckpt.apply_retention(tmp_path, keep=1)
        assert names(tmp_path) == ["step-000010", "step-000030"]
        ckpt.apply_retention(tmp_path, keep=1)  # every later retention too, while the hold lasts
        assert names(tmp_path) == ["step-000010", "step-000030"]
    assert not is_held(tmp_path, "step-000010")
    assert list((tmp_path / "holds").iterdir()) == []  # the hold file is gone with the hold
    ckpt.apply_retention(tmp_path, keep=1)
    assert names(tmp_path) == ["step-000030"]


def test_a_hold_taken_while_retention_renames_the_checkpoint_gives_it_back(tmp_path: Path):
    """The race without a lock: retention has renamed step-10 out of the step names when a reader takes its hold.
    Retention looks again after the rename, sees the hold and renames it back; the reader finds it there."""
    path = write_tiny_checkpoint(tmp_path, 10)
    write_tiny_checkpoint(tmp_path, 20)
    reader = Hold(tmp_path, "step-000010")

    def hold_now() -> bool:  # what retention asks once step-10 is renamed: the reader's hold lands at that moment
        assert not path.exists() and (path.parent / ".tmp-delete-step-000010").is_dir()
        reader.__enter__()
        return is_held(tmp_path, "step-000010")

    try:
        assert remove_step_dir(path, spare=hold_now) is False
        assert still_there(path) and names(tmp_path) == ["step-000010", "step-000020"]
        ckpt.verify(path)  # whole: not a file was lost on the way
    finally:
        reader.release()
    assert remove_step_dir(path, spare=lambda: is_held(tmp_path, "step-000010")) is True
    assert not still_there(path, wait_s=0)


def test_holds_of_gone_holders_do_not_count_and_are_cleaned_up(tmp_path: Path):
    holds = tmp_path / "holds"
    holds.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    def plant(name: str, pid: int, age_s: float) -> Path:
        path = holds / name
        path.write_text(json.dumps({"checkpoint": name.split(".")[0], "pid": pid, "host": socket.gethostname()}))
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))
        return path

    alive = plant("step-000010.alive", os.getpid(), 0)
    dead = plant("step-000020.dead", int(ended.stdout), 0)  # a watcher killed on this machine: stale at once
    old = plant("step-000030.old", os.getpid(), HOLD_TTL_S + 5)  # not refreshed: its machine is gone
    future = plant("step-000040.future", os.getpid(), -3600)  # a copied file's time in the future never counts
    assert [hold_is_live(p) for p in (alive, dead, old, future)] == [True, False, False, False]
    assert is_held(tmp_path, "step-000010") and not is_held(tmp_path, "step-000020")
    assert remove_stale_holds(tmp_path) == 3
    assert sorted(p.name for p in holds.iterdir()) == ["step-000010.alive"]


def test_a_link_at_holds_is_refused_and_links_in_it_never_count(tmp_path: Path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    (run / "holds").symlink_to(elsewhere)
    with pytest.raises(WritePathError, match="symbolic link"):
        Hold(run, "step-000010").__enter__()
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    (elsewhere / "step-000010.x").write_text("{}")
    assert not is_held(run, "step-000010")  # holds/ read through a link: never
    (run / "holds").unlink()
    (run / "holds").mkdir()
    (run / "holds" / "step-000010.y").symlink_to(elsewhere / "step-000010.x")
    assert not is_held(run, "step-000010")  # a link as a hold: never
    remove_stale_holds(run)
    assert (elsewhere / "step-000010.x").is_file()  # and nothing it names is deleted


# A holder in a process of its own that stops itself (SIGSTOP) at its first call of os.<argv[2]> while it takes its
# hold: nanopt.files.create_file's write of the hold's contents, or its rename to the hold's name. There the test
# kills it, as SIGKILL or the OOM killer may at any moment, or lets another reader start. Let go (SIGCONT), it says
# "held" once it holds step-000010, and keeps the hold until its stdin closes.
HOLDER = """
import os, signal, sys
from pathlib import Path
from nanopt.train.checkpoint.hold import Hold
run, call = Path(sys.argv[1]), sys.argv[2]
real = getattr(os, call)
def pause_once(*args):
    setattr(os, call, real)
    os.kill(os.getpid(), signal.SIGSTOP)
    return real(*args)
setattr(os, call, pause_once)
with Hold(run, "step-000010"):
    if getattr(os, call) is pause_once:
        sys.exit(f"took its hold without calling os.{call}")
    print("held", flush=True)
    sys.stdin.read()
"""


def holder_paused_at(run: Path, call: str) -> subprocess.Popen:
    env = {**os.environ, **HIDE_CUDA, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), call], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120  # starting Python and importing nanopt, on a loaded machine
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            assert os.WIFSTOPPED(status), f"the holder ended before it paused at os.{call} ({status})"
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the holder never paused at os.{call}")


@pytest.mark.parametrize("call", ["write", "rename"])
def test_a_holder_killed_while_it_takes_its_hold_holds_nothing(tmp_path: Path, call: str):
    """Killed between creating its hold's file and writing it, a holder left an empty hold, which counted for
    HOLD_TTL_S (10 minutes) and no watcher removed: the checkpoint outlived its retention, and a restarted watcher
    left the file behind. Now the contents are written before the hold's name appears."""
    for step in (10, 20):
        write_tiny_checkpoint(tmp_path, step)
    holder = holder_paused_at(tmp_path, call)
    holder.kill()
    holder.communicate(timeout=60)
    assert not is_held(tmp_path, "step-000010")
    ckpt.apply_retention(tmp_path, keep=1)
    assert names(tmp_path) == ["step-000020"]
    remove_stale_holds(tmp_path)  # as the next watcher does when it starts
    assert list((tmp_path / "holds").iterdir()) == []


def test_a_holder_whose_staged_hold_a_starting_watcher_removes_still_takes_it(tmp_path: Path):
    for step in (10, 20):
        write_tiny_checkpoint(tmp_path, step)
    holder = holder_paused_at(tmp_path, "rename")  # its hold written whole under .tmp-, not yet under its name
    try:
        assert remove_stale_holds(tmp_path) == 1  # another watcher starting: a .tmp- file is never a hold
        holder.send_signal(signal.SIGCONT)
        assert holder.stdout.readline() == "held\n"
        assert is_held(tmp_path, "step-000010")
        ckpt.apply_retention(tmp_path, keep=1)
        assert names(tmp_path) == ["step-000010", "step-000020"]
    finally:
        holder.send_signal(signal.SIGCONT)  # (still paused if an assertion above failed)
        holder.communicate(timeout=60)  # closes its stdin: the hold ends
    assert holder.returncode == 0
    assert list((tmp_path / "holds").iterdir()) == []


def test_a_hold_names_a_checkpoint_never_a_path(tmp_path: Path):
    with pytest.raises(ValueError):
        Hold(tmp_path, "../../etc")


# ------------------------------------------------------------------------------------------------ the CLI


@pytest.mark.parametrize("planted", ["eval_history.jsonl", "holds"])
def test_a_link_where_the_watcher_writes_is_refused(tmp_path: Path, cli_in_process, planted: str):
    run = tmp_path / "run"
    write_tiny_checkpoint(run, 10)
    target = tmp_path / "target"
    target.mkdir() if planted == "holds" else target.write_text("theirs\n")
    (run / planted).symlink_to(target)
    result = cli_in_process("eval", run, *WATCH)
    assert_user_error(result, planted, "symbolic link")
    assert (list(target.iterdir()) == []) if planted == "holds" else target.read_text() == "theirs\n"


def test_watch_options_are_checked_first(tmp_path: Path, cli_in_process):
    assert_user_error(cli_in_process("eval", tmp_path, tmp_path, "--watch"), "--watch follows one run")
    assert_user_error(cli_in_process("eval", tmp_path, "--watch", "--poll", "0"), "--poll")
    assert_user_error(cli_in_process("eval", tmp_path, "--watch", "--no-loss"), "needs the loss")
    assert_user_error(cli_in_process("eval", tmp_path, "--watch", "--device", "tpu:0"), "--device")
    assert_user_error(cli_in_process("eval", tmp_path, "--device", "cuda:99"), "--device")
    assert_user_error(cli_in_process("eval", tmp_path, "--device", "cpu", "--nproc-per-node", "2"), "--device")


def test_a_result_appended_after_a_torn_line_is_kept(tmp_path: Path):
    # An eval killed inside its write (or a machine that lost power) leaves a last line without its newline. The
    # next result must not be glued onto it: readers skip a line that is no JSON, and would lose both.
    from nanopt.evaluate.history import append_result
    from nanopt.train.observe.eval_history import read_history

    first = {"step": 2, "tokens_trained": 128, "test_loss": 4.8, "settings": {}}
    (tmp_path / "eval_history.jsonl").write_text(json.dumps(first) + "\n" + '{"step": 4, "tok')
    opts = SimpleNamespace(data=None, tokens=None, samples=None, tasks=None, harness=None)
    append_result(tmp_path, {"step": 6, "tokens_trained": 384, "test_loss": 4.1, "settings": {}}, {}, opts)
    assert [r["step"] for r in read_history(tmp_path)] == [2, 6]
    assert (tmp_path / "eval_history.jsonl").read_text().endswith("\n")
    append_result(tmp_path, {"step": 8, "tokens_trained": 512, "test_loss": 4.0, "settings": {}}, {}, opts)  # whole
    assert [r["step"] for r in read_history(tmp_path)] == [2, 6, 8]
    assert (tmp_path / "eval_history.jsonl").read_text().count("\n\n") == 0  # no newline added to a whole one


def test_the_comparison_chart_draws_each_runs_test_loss_from_its_history(tmp_path: Path):
    from nanopt.evaluate.charts import comparison_figure
    from nanopt.train.observe.metrics import loss_chart

    runs = [tmp_path / "a", tmp_path / "b"]
    for index, run in enumerate(runs):
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "tokens": 64 * s,
                                                               "loss": 5.0 - s / 10}) + "\n" for s in (1, 2, 3)))
        results = [{"step": s, "tokens_trained": 64 * s, "test_loss": 5.0 - s / 10 - index, "settings": {}}
                   for s in (2, 3)]
        (run / "eval_history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results) + '{"step": 4, "tok')
    figure = comparison_figure(runs, ["a", "b"])
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    assert list(lines["a test"].get_xdata()) == [128, 192] and list(lines["b test"].get_ydata()) == [3.8, 3.7]
    own = {line.get_label(): line for line in loss_chart(runs[0]).axes[0].get_lines()}  # and the run's loss.png
    assert list(own["test (nanopt eval)"].get_xdata()) == [128, 192]
    (runs[1] / "eval_history.jsonl").unlink()
    os.mkfifo(runs[1] / "eval_history.jsonl")  # never blocks, never stops a training's chart: no test points
    assert "test (nanopt eval)" not in {line.get_label() for line in loss_chart(runs[1]).axes[0].get_lines()}


# ----------------------------------------------------------------------------------- beside a real training


def start_watcher(run: Path, logs: Path, *extra: object, sigint_ignored: bool = False) -> subprocess.Popen:
    """`nanopt eval RUN --watch` in a process of its own, started from scratch as a person starts it (with SIGINT
    ignored, as a background job of a script inherits it, if asked); returns once it is watching."""
    err = logs / f"watch-{time.monotonic_ns()}.err"
    env = {**os.environ, **HIDE_CUDA, "COLUMNS": "200", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "nanopt", "eval", str(run), *WATCH, *map(str, extra)]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(err, "w"),  # noqa: SIM115
                            text=True, preexec_fn=ignore)
    proc.err_path = err
    deadline = time.monotonic() + 120
    while "watching" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, err.read_text()
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out, proc.err_path.read_text()


@pytest.mark.slow
def test_every_checkpoint_is_scored_once_in_order_beside_training(tmp_path: Path, tiny_dataset: Path,
                                                                   launcher: Launcher, cli_in_process):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, checkpoint_interval=3, keep_checkpoints=10,
                   eval_interval=6)
    watcher = start_watcher(run, tmp_path, "--json")
    launcher.train(run)
    trained = tree_digest(run / "checkpoints")
    code, out, err = finish(watcher)
    assert code == 0, err
    steps = [r["step"] for r in read_history(run)]
    assert steps == [3, 6, 9, 12], err  # each once, in order, and it ended with the run
    assert [json.loads(line)["step"] for line in out.splitlines()[:-1]] == steps
    assert json.loads(out.splitlines()[-1])["summary"]["ended"] == "completed"
    assert json.loads((run / "eval.json").read_text())["step"] == 12
    # Nothing written into checkpoints/: no eval.json beside any checkpoint, and no file changed since training.
    assert not list((run / "checkpoints").rglob("eval.json"))
    assert tree_digest(run / "checkpoints") == trained
    assert list((run / "holds").iterdir()) == []
    # The comparison reads the history: with the watcher's settings, nothing is evaluated again.
    shutil.copytree(run, tmp_path / "copy")
    compared = json.loads(cli_in_process("eval", run, tmp_path / "copy", "--no-samples", "--tokens", "512",
                                         "--device", "cpu", "--json").stdout)
    assert [r.get("reused") for r in compared["runs"]] == [True, True]
    assert {r["test_loss"] for r in compared["runs"]} == {read_history(run)[-1]["test_loss"]}


@pytest.mark.slow
def test_with_keep_1_each_checkpoint_is_scored_or_said_to_be_missed(tmp_path: Path, tiny_dataset: Path,
                                                                    launcher: Launcher):
    """A watcher slower than the saves: retention (keep_checkpoints 1) deletes what it has not held yet. Every
    checkpoint written while it watched is then either scored, in order, or named as deleted before it looked."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=12, checkpoint_interval=2, keep_checkpoints=1,
                   eval_interval=0)
    watcher = start_watcher(run, tmp_path, "--json", "--poll", "0.5")
    launcher.train(run)
    code, out, err = finish(watcher)
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])["summary"]
    missed = sorted(int(name.removeprefix("step-")) for name in summary["passed_over"])
    assert summary["scored"] == sorted(summary["scored"]) and summary["scored"][-1] == 12
    assert sorted(summary["scored"] + missed) == [2, 4, 6, 8, 10, 12], err
    assert all(f"step-{s:06d}: not scored: deleted by the training's retention" in err for s in missed)
    assert [r["step"] for r in read_history(run)] == summary["scored"]


def test_a_checkpoint_pruned_as_watching_began_is_said_to_be_missed(tmp_path: Path, tiny_dataset: Path,
                                                                     cli_in_process):
    """A training started on the "watching" line may save, and its retention delete, at once: that checkpoint is
    named as missed. Its event is recorded as "watching" is said, with the time rounded down to the ms (metrics.jsonl
    rounds to the ms): the earliest time a checkpoint saved after the watcher started can carry."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=4, checkpoint_interval=4, eval_interval=0)
    assert cli_in_process("train", run, "--no-live").returncode == 0
    pruned = run / "checkpoints" / "step-000002"

    class SavedAndPrunedAsWatchingIsSaid(WatchEvents):
        def started(self, device: str) -> None:
            record = {"kind": "event", "event": "checkpoint", "step": 2, "path": str(pruned),
                      "time": math.floor(time.time() * 1000) / 1000}
            with (run / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    summary = watch_run(run, EvalOptions(samples=None, tokens=512), poll_s=0.05, device="cpu",
                        events=SavedAndPrunedAsWatchingIsSaid())
    assert summary.scored == [4] and list(summary.passed_over) == [pruned.name]


@pytest.mark.slow
def test_a_killed_watcher_restarted_skips_what_it_scored(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=16, checkpoint_interval=2, keep_checkpoints=10,
                   eval_interval=0)
    launcher.train(run)
    tasks = ("--tasks", "hellaswag,piqa", "--task-data", write_task_data(tmp_path / "tasks"))  # scored each time too
    first = start_watcher(run, tmp_path, *tasks)
    history = run / "eval_history.jsonl"
    deadline = time.monotonic() + 120
    while (not history.exists() or len(read_history(run)) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    before = [r["step"] for r in read_history(run)]
    assert before and before == sorted(before)
    second = start_watcher(run, tmp_path, "--json", *tasks)
    code, out, err = finish(second)
    assert code == 0, err
    assert [r["step"] for r in read_history(run)] == [2, 4, 6, 8, 10, 12, 14, 16]  # nothing scored twice
    assert all(set(r["tasks"]) == {"hellaswag", "piqa"} for r in read_history(run))
    summary = json.loads(out.splitlines()[-1])["summary"]
    assert summary["skipped"] == before and summary["scored"] == [s for s in range(2, 17, 2) if s not in before]
    assert list((run / "holds").iterdir()) == []  # the killed watcher's hold was stale, and removed


@pytest.mark.slow
def test_ctrl_c_ends_the_watcher_cleanly(tmp_path: Path, tiny_dataset: Path):
    run = tiny_run(tmp_path, tiny_dataset, "run")  # never trained: the watcher waits for a first checkpoint
    # Started with SIGINT ignored, as a script's background job is (and as CI's runner may start the suite): the
    # watcher sets its own handler, so Ctrl-C still stops it. Left to Python, it never stopped.
    watcher = start_watcher(run, tmp_path, sigint_ignored=True)
    watcher.send_signal(signal.SIGINT)
    code, out, err = finish(watcher)
    assert code == 130 and "Traceback" not in err, err
    assert "0 checkpoint(s) scored" in err and "stopped" in err
    assert not (run / "eval_history.jsonl").exists()
