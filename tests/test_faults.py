"""Faults a paid run meets, through the real `nanopt train`: SIGKILL at random moments, preemption by SIGTERM /
SIGINT, a full disk, damaged checkpoints, divergence, a rank that dies or hangs; and what the package may load.

Each scenario ends by comparing with an uninterrupted run: the same loss at every step and the same final weights.

Every run is forked from a warm launcher (tests/faulthelp.py: the same entry point as `python -m nanopt`, without a
3 s import per start); each is a real process with its own signals, files and exit status. Runs on two ranks are
`nanopt train --nproc-per-node 2` forked the same way: that process runs torchrun, whose two gloo ranks are fresh
Python processes, as for a user.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import psutil
import pytest
from clihelp import REPO
from faulthelp import HANG_GUARD_S, Child, Launcher, tiny_run, tree_digest
from trainhelp import eval_losses, final_weights_hash, losses

from nanopt.train import checkpoint as ckpt

STOPPED_EARLY = 75  # nanopt's exit status for a run stopped by SIGTERM / SIGINT after saving (see README)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """The uninterrupted single-process run every scenario is compared with."""
    run = tiny_run(tmp_path_factory.mktemp("reference"), tiny_dataset, "reference")
    launcher.train(run)
    return run


def copy_run(reference: Path, dest: Path) -> Path:
    """A fresh run directory with the reference's configuration and nothing trained."""
    run = dest / reference.name
    run.mkdir(parents=True)
    for name in ("model.json", "train.json"):
        shutil.copy(reference / name, run / name)
    return run


def assert_same_run(run: Path, reference: Path) -> None:
    """Every step trained exactly once with the reference's loss, the same evals, the same final weights."""
    assert losses(run) == losses(reference)
    assert sorted(losses(run)) == list(range(1, len(losses(reference)) + 1))
    assert eval_losses(run) == eval_losses(reference)
    assert final_weights_hash(run) == final_weights_hash(reference)


def steps_logged(run: Path) -> list[int]:
    try:
        return sorted(losses(run))
    except (FileNotFoundError, json.JSONDecodeError):
        return []  # not written yet, or a line torn by a kill


def resumed_step(stderr: str) -> int | None:
    found = re.search(r"resumed from \S+step-(\d+) ", stderr)
    return int(found.group(1)) if found else None


def resume_step(run: Path) -> int | None:
    """The step `nanopt train` resumes from: the checkpoint `latest` names (the newest valid one without it). A
    kill between a checkpoint's rename and the pointer's update leaves a newer complete one that it passes over."""
    found, _ = ckpt.latest(run)
    return found.step if found else None


# ------------------------------------------------------------------------------------- 1. SIGKILL anywhere


def kill_at_random_moment(launcher: Launcher, run: Path, rng: random.Random) -> Child:
    """Start `nanopt train` and SIGKILL it at a moment drawn by `rng`: while it starts or resumes, just after a
    new checkpoint directory appears (mid-write, rename, pointer or retention), or a few steps into training."""
    ckpts, resume_at = run / "checkpoints", resume_step(run) or 0
    seen = set(os.listdir(ckpts)) if ckpts.is_dir() else set()
    moment = rng.choice(["starting", "writing", "training"])
    delay = {"starting": rng.uniform(0, 0.5), "writing": rng.uniform(0, 0.015), "training": rng.uniform(0, 0.03)}
    target = resume_at + rng.randint(1, 4)
    before = _inode(run / "metrics.jsonl")
    child = launcher.start("train", run, "--no-live")
    started, kill_at = time.monotonic(), None
    while kill_at is None and not launcher.finished(child) and time.monotonic() - started < HANG_GUARD_S:
        trained = _steps_this_session(run, before, resume_at)
        if moment == "starting" and (time.monotonic() - started > delay["starting"] or trained):
            kill_at = time.monotonic()  # never let a "starting" kill run far into training
        elif moment == "writing" and any(n.startswith(".tmp-step-") and n not in seen for n in _names(ckpts)):
            kill_at = time.monotonic() + delay["writing"]
        elif moment == "training" and trained and max(trained) >= target:
            kill_at = time.monotonic() + delay["training"]
        time.sleep(0.0005)
    while kill_at is not None and time.monotonic() < kill_at:
        pass  # a busy wait: sleeping would round these few milliseconds up
    if kill_at is not None:
        os.kill(child.pid, signal.SIGKILL)
    launcher.wait(child)
    return child


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _names(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _steps_this_session(run: Path, inode_before: int | None, resume_at: int) -> list[int]:
    """Steps trained by the running session: metrics.jsonl is rewritten (a new inode) when a session starts."""
    if _inode(run / "metrics.jsonl") in (None, inode_before):
        return []
    return [step for step in steps_logged(run) if step > resume_at]


@pytest.mark.slow  # a kill loop: 24 kills and resumes (CI's slow stage)
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path: Path, reference: Path,
                                                                           launcher: Launcher):
    run = copy_run(reference, tmp_path)
    rng = random.Random(20240611)  # reproducible kill moments
    kills = 0
    for _ in range(40):
        expected = resume_step(run)
        child = kill_at_random_moment(launcher, run, rng)
        if child.status == 0:  # it finished before its moment came: start over to keep killing
            shutil.rmtree(run / "checkpoints")
            (run / "metrics.jsonl").unlink()
            continue
        assert child.status == -signal.SIGKILL, child.stderr[-3000:]
        kills += 1
        # Each restart continues from the checkpoint `latest` names, and no kill damages one.
        assert resumed_step(child.stderr) in (expected, None), child.stderr[-2000:]
        assert "damaged" not in child.stderr
        for path in (run / "checkpoints").glob("step-*"):  # not even an old one being deleted by retention
            ckpt.verify(path)
        if kills == 24:
            break
    assert kills >= 20
    expected = resume_step(run)
    final = launcher.train(run)
    assert resumed_step(final.stderr) == expected
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert_same_run(run, reference)


# ------------------------------------------------------------------------------------- 2. SIGTERM / SIGINT


def wait_for_step(run: Path, step: int, alive) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while alive() and time.monotonic() < deadline and not [s for s in steps_logged(run) if s >= step]:
        time.sleep(0.005)


def assert_preempted_and_saved(run: Path, status: int, stderr: str, signame: str) -> int:
    """Exit status 75, the message, and a checkpoint at the step it stopped at, written once by rank 0 with every
    rank's loader and RNG state in it."""
    assert status == STOPPED_EARLY, stderr[-3000:]
    assert f"received {signame}: finishing this step, saving a checkpoint" in stderr
    saved = re.search(r"preempted: saved step (\d+); run `nanopt train \S+` to continue", stderr)
    assert saved, stderr[-3000:]
    step = int(saved.group(1))
    assert step < 40 and max(steps_logged(run)) == step
    assert ckpt.read_pointer(run / "checkpoints", "latest") == ckpt.step_dir_name(step)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "checkpoint"].count(step) == 1
    return step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_preemption_saves_and_exits_75_then_resume_is_exact(tmp_path: Path, reference: Path, launcher: Launcher,
                                                            sig: signal.Signals):
    run = copy_run(reference, tmp_path)
    child = launcher.start("train", run, "--no-live")
    wait_for_step(run, 5, lambda: not launcher.finished(child))
    os.kill(child.pid, sig)
    launcher.wait(child)
    step = assert_preempted_and_saved(run, child.status, child.stderr, sig.name)
    assert len(ckpt.resolve(run, "latest").meta["ranks"]) == 1
    resumed = launcher.train(run)
    assert resumed_step(resumed.stderr) == step
    assert_same_run(run, reference)


@pytest.fixture(scope="module")
def reference_2ranks(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """An uninterrupted run on 2 gloo ranks, 20 steps."""
    run = tiny_run(tmp_path_factory.mktemp("reference2"), tiny_dataset, "reference", max_steps=20)
    result = train_2ranks(launcher, run)
    assert result.status == 0, result.stderr[-3000:]
    return run


def start_2ranks(launcher: Launcher, run: Path, *args: str, env: dict[str, str] | None = None) -> Child:
    """`nanopt train RUN --nproc-per-node 2`: a process that runs torchrun, which starts the two ranks."""
    return launcher.start("train", run, "--no-live", "--nproc-per-node", "2", *args, env=env)


def finish(launcher: Launcher, job: Child) -> Child:
    """The job once it exits; a hung job is killed with every process it started, and fails the test."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not launcher.finished(job):
        if time.monotonic() > deadline:
            for process in psutil.Process(job.pid).children(recursive=True):
                process.kill()
            os.kill(job.pid, signal.SIGKILL)
            launcher.wait(job)
            raise AssertionError(f"the job did not end within {HANG_GUARD_S} s; stderr:\n{job.stderr[-3000:]}")
        time.sleep(0.02)
    return job


def train_2ranks(launcher: Launcher, run: Path, *args: str) -> Child:
    return finish(launcher, start_2ranks(launcher, run, *args))


# Slow (10 s): torchrun's forwarding of the notice; the stop itself is make test's in one process
# (test_preemption_saves_and_exits_75_then_resume_is_exact), a two-rank resume in tests/test_muon.py.
@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_with_one_checkpoint_then_resume_is_exact(tmp_path: Path,
                                                                                      reference_2ranks: Path,
                                                                                      launcher: Launcher):
    run = copy_run(reference_2ranks, tmp_path)
    job = start_2ranks(launcher, run)
    wait_for_step(run, 5, lambda: not launcher.finished(job))
    os.kill(job.pid, signal.SIGTERM)  # the scheduler's preemption notice, to the launcher as it would arrive
    err = finish(launcher, job).stderr
    step = assert_preempted_and_saved(run, job.status, err, "SIGTERM")
    assert "stopped by SIGTERM: run the same command again" in err and "Traceback" not in err
    assert len(ckpt.resolve(run, "latest").meta["ranks"]) == 2  # both ranks' positions, in one checkpoint
    resumed = train_2ranks(launcher, run)
    assert resumed.status == 0, resumed.stderr[-3000:]
    assert resumed_step(resumed.stderr) == step
    assert_same_run(run, reference_2ranks)


# ---------------------------------------------------------------------------------------------- 3. full disk


def test_a_full_disk_is_one_line_exit_2_and_keeps_checkpoints(tmp_path: Path, reference: Path, launcher: Launcher):
    run = copy_run(reference, tmp_path)
    child = launcher.start("train", run, "--no-live")
    wait_for_step(run, 5, lambda: not launcher.finished(child))
    os.kill(child.pid, signal.SIGTERM)
    assert launcher.wait(child) == STOPPED_EARLY, child.stderr[-3000:]
    before = tree_digest(run / "checkpoints")
    sizes = [p.stat().st_size for p in (run / "checkpoints").glob("step-*/*.safetensors")]
    # A file-size limit stands in for the disk filling up: first just past what metrics.jsonl holds now (room for
    # the resume event, not for the next step's record), then between the weights and the larger optimizer state.
    for limit in ((run / "metrics.jsonl").stat().st_size + 100, (min(sizes) + max(sizes)) // 2):
        full = launcher.run("train", run, "--no-live", fsize=limit)
        assert full.status == 2, full.stderr[-3000:]
        errors = [line for line in full.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert "could not write" in errors[0] and "File too large" in errors[0]
        assert "Hint: free disk space" in errors[0]
        assert tree_digest(run / "checkpoints") == before  # nothing half-written, `latest` unchanged
    resumed = launcher.train(run)
    assert resumed_step(resumed.stderr) == newest_step_in(before)
    assert_same_run(run, reference)


def newest_step_in(digest: dict[str, str]) -> int:
    return max(int(name.split("/")[0].removeprefix("step-")) for name in digest if name.startswith("step-"))


# ------------------------------------------------------------------------------------- 4. damaged checkpoint


def damage(checkpoint: Path, how: str) -> None:
    weights = checkpoint / "model.safetensors"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "bit-flipped":
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x10  # one bit in the middle of the tensor data
        weights.write_bytes(bytes(data))
    elif how == "no meta.json":
        (checkpoint / "meta.json").unlink()
    else:  # a meta.json cut short
        meta = checkpoint / "meta.json"
        meta.write_text(meta.read_text()[:100])


@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "no meta.json", "torn meta.json"])
def test_damaged_newest_checkpoint_falls_back_and_says_so(tmp_path: Path, reference: Path, launcher: Launcher,
                                                          how: str):
    run = shutil.copytree(reference, tmp_path / "run")
    newest = run / "checkpoints" / "step-000040"
    damage(newest, how)
    resumed = launcher.train(run)
    assert "skipping a damaged checkpoint" in resumed.stderr and str(newest) in resumed.stderr
    assert resumed_step(resumed.stderr) == 38
    ckpt.verify(newest)  # written again, complete
    assert_same_run(run, reference)


# ---------------------------------------------------------------------------------------- 5. divergence


@pytest.mark.parametrize("nproc", [1, 2])
def test_divergence_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path, reference: Path,
                                                                           reference_2ranks: Path,
                                                                           launcher: Launcher, nproc: int):
    done = reference if nproc == 1 else reference_2ranks
    run = shutil.copytree(done, tmp_path / "run")
    last = max(losses(done))
    before = tree_digest(run / "checkpoints")
    # A learning rate of 1e30 really diverges: the first step sends the weights to ~1e30, every later gradient is
    # NaN. Ten more steps with a checkpoint every 2 would otherwise save the broken weights as `latest`.
    args = ("--set", f"max_steps={last + 10}", "--set", "learning_rate=1e30", "--allow-changed")
    result = finish(launcher, launcher.start("train", run, "--no-live", "--nproc-per-node", nproc, *args))
    status, stderr = result.status, result.stderr
    assert status == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert f"training diverged: 5 non-finite steps in a row at step {last + 6}" in errors[0]
    assert "Hint: resume from the last checkpoint with a lower learning rate" in errors[0]
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [e["step"] for e in events if e.get("event") == "nonfinite_skipped"]
    assert skipped == list(range(last + 2, last + 7))
    assert tree_digest(run / "checkpoints") == before
    # The hint works: the last good checkpoint trains on at the configured learning rate.
    if nproc == 1:
        recovered = launcher.train(run, "--set", f"max_steps={last + 4}", "--allow-changed")
        assert resumed_step(recovered.stderr) == last
        assert all(math.isfinite(losses(run)[step]) for step in range(last + 1, last + 5))


def test_a_loss_spike_after_resuming_with_a_higher_learning_rate_is_reported(tmp_path: Path, reference: Path,
                                                                             launcher: Launcher):
    run = shutil.copytree(reference, tmp_path / "run")
    spiked = launcher.train(run, "--set", "max_steps=44", "--set", "learning_rate=10", "--set", "recovery=false",
                            "--allow-changed")
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    spikes = [e for e in events if e.get("event") == "loss_spike"]
    assert spikes and spikes[0]["step"] == 42  # the first loss measured after one step at the new rate
    assert spikes[0]["loss"] == losses(run)[42] > 2 * losses(reference)[40] and spikes[0]["zscore"] > 6
    assert re.search(r"step 42: loss spike \d+\.\d+ \(\d+\.\d standard deviations above the mean\)",
                     spiked.stderr)


# ------------------------------------------------------------------------------------ 7. a rank dies or hangs


def workers_of(job: Child) -> list[psutil.Process]:
    """The training processes torchrun started (children of the `nanopt train --nproc-per-node` process)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        workers = [c for c in psutil.Process(job.pid).children() if _is_worker(c)]
        if len(workers) == 2:
            return sorted(workers, key=lambda w: w.pid)
        time.sleep(0.05)
    raise AssertionError("torchrun did not start two workers")


def _is_worker(child: psutil.Process) -> bool:
    # Between fork and exec a child still shows its parent's command line and environment (no RANK yet).
    try:
        return "nanopt" in " ".join(child.cmdline()) and "RANK" in child.environ()
    except psutil.Error:  # gone, or not yet readable
        return False


def rank_of(worker: psutil.Process) -> int:
    return int(worker.environ()["RANK"])


def test_a_killed_rank_ends_the_job_with_a_message_and_checkpoints_stay_valid(tmp_path: Path,
                                                                              reference_2ranks: Path,
                                                                              launcher: Launcher):
    run = copy_run(reference_2ranks, tmp_path)
    job = start_2ranks(launcher, run)
    victim = next(w for w in workers_of(job) if rank_of(w) == 1)
    wait_for_step(run, 5, lambda: not launcher.finished(job))
    victim.send_signal(signal.SIGKILL)  # the out-of-memory killer, say
    err = finish(launcher, job).stderr  # the job must end, not wait forever
    assert job.status == 1, err[-3000:]
    assert f"error: rank 1 (pid {victim.pid}) was killed by SIGKILL, so torchrun stopped the others" in err
    assert "Traceback" not in err
    for path in ckpt.complete_checkpoints(run):
        ckpt.verify(path)
    expected = resume_step(run)
    resumed = launcher.train(run, "--allow-changed")  # on one rank: the loader position is global
    assert resumed_step(resumed.stderr) == expected and max(losses(run)) == 20


def test_a_hung_rank_times_out_at_the_next_collective(tmp_path: Path, reference_2ranks: Path, launcher: Launcher):
    run = copy_run(reference_2ranks, tmp_path)
    job = start_2ranks(launcher, run, env={"NANOPT_PG_TIMEOUT_S": "5"})
    workers = {rank_of(w): w for w in workers_of(job)}
    wait_for_step(run, 5, lambda: not launcher.finished(job))
    workers[1].suspend()  # SIGSTOP: alive, so torchrun sees nothing wrong; only the timeout can end the wait
    try:
        psutil.wait_procs([workers[0]], timeout=HANG_GUARD_S)
    finally:
        workers[1].resume()  # let it take torchrun's SIGTERM, so the test does not wait out torchrun's grace
    err = finish(launcher, job).stderr
    assert job.status != 0
    assert re.search(r"error: rank 0 lost contact with another rank at step \d+ \(.*Timed out", err), err[-3000:]
    assert "NANOPT_PG_TIMEOUT_S" in err and "Traceback" not in err
    for path in ckpt.complete_checkpoints(run):
        ckpt.verify(path)


@pytest.mark.slow  # two ranks, one stopped for the stall timeout
def test_a_stalled_run_says_where_each_rank_waits_and_when_progress_resumes(tmp_path: Path,
                                                                           reference_2ranks: Path,
                                                                           launcher: Launcher):
    # A stopped rank 1 leaves rank 0 waiting in the step's all-reduce, well inside the process group's timeout: a
    # hung run that looks alive. After stall_timeout_s without progress, rank 0 writes every thread's stack,
    # records the stall and says so; when rank 1 goes on, so does the run, and that is recorded too.
    run = copy_run(reference_2ranks, tmp_path)
    job = start_2ranks(launcher, run, "--set", "stall_timeout_s=5")
    workers = {rank_of(w): w for w in workers_of(job)}
    wait_for_step(run, 5, lambda: not launcher.finished(job))
    stacks = run / "stalls" / "rank-0.txt"
    workers[1].suspend()
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not stacks.exists() and time.monotonic() < deadline and not launcher.finished(job):
            time.sleep(0.05)
        text = stacks.read_text() if stacks.exists() else ""  # this stall's (a later one would replace it whole)
    finally:
        workers[1].resume()
    result = finish(launcher, job)
    assert result.status == 0, result.stderr[-3000:]
    # Where the main thread waits: the step's all-reduce, DDP's inside the backward, or a checkpoint's collective.
    main = text[text.find("Thread MainThread (most recent call last):"):]
    assert text.startswith("nanopt train: rank 0 of 2: no progress for") and "nanopt/train/loop.py" in main, text
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stalls = [e for e in events if e.get("event") == "stall"]
    # The first is the one the stop caused (a loaded machine may pause the run again later: another stall, rightly).
    assert stalls and stalls[0]["step"] >= 5 and stalls[0]["idle_s"] >= 5, stalls
    # Rank 0 waits in the step or in the evaluation's or a checkpoint's collective (one is due every few steps
    # here): wherever it is, the event, the file and the message say the same.
    phase = stalls[0]["phase"]
    assert phase in ("training", "evaluation or checkpoint") and f"(phase {phase})" in text.splitlines()[0]
    assert stalls[0]["stacks"] == str(stacks)
    assert [e["step"] for e in events if e.get("event") == "stall_over"][0] == stalls[0]["step"]
    assert re.search(rf"health: stall: no progress for \d+ s in {phase} \(stall_timeout_s 5\)", result.stderr)
    assert max(losses(run)) == 20


# ------------------------------------------------------------------------------------------ 8. safe loading

PACKAGE = REPO / "nanopt"


# Loading a pickle (torch.load without weights_only=True, pickle itself, numpy's allow_pickle) or a hub repository's
# code runs whatever the file says; a checkpoint or dataset from elsewhere must never be able to do that.
UNSAFE = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b|\b(c?pickle|dill|joblib)\.(loads?|Unpickler)\b"
                    r"|allow_pickle\s*=\s*True|trust_remote_code\s*=\s*True")


# The one exception: the shard index of a sharded checkpoint (DCP's `.metadata`, a pickle) is read by an unpickler
# whose globals are stand-ins made for that one read (tests/test_shard_index_pickle.py feeds it crafted indexes).
ALLOW_LISTED = {("nanopt/train/checkpoint/shard_index.py", "import pickle"),
                ("nanopt/train/checkpoint/shard_index.py", "class RecordingUnpickler(pickle.Unpickler):")}


def test_the_package_never_unpickles_or_runs_remote_code():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            unsafe_torch_load = "torch.load(" in code and "weights_only=True" not in code
            if (str(path.relative_to(REPO)), line.strip()) in ALLOW_LISTED:
                continue
            if unsafe_torch_load or UNSAFE.search(code):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_checkpoints_hold_only_safetensors_and_json(reference: Path):
    step_dirs = [p for p in (reference / "checkpoints").iterdir() if p.is_dir()]
    assert step_dirs
    for directory in step_dirs:
        suffixes = {p.suffix for p in directory.iterdir()}
        assert suffixes == {".safetensors", ".json"}, (directory, suffixes)
