"""`nanopt slurm`'s job script under a real SLURM (slurmctld, slurmd and munged of the test's own, tests/slurmhelp.py):
submitted with sbatch, the script trains a CPU run on two ranks to its end; requeued at a random moment, or cut into
pieces by a time limit shorter than the run, it comes back and ends with the losses of a run never interrupted; a
finished run, a mistake in train.json and a scancel each end the job once. And what sbatch and srun make of nanopt:
a run directory with a space in its path, the batch script and a step of fewer tasks than the job.

The time limit: the script's own lead (USR1 300 s before the limit) scaled down for a run of a minute, as a user
would pass it to sbatch: `--time=1 --signal=B:USR1@1`. slurmctld looks at limits every 30 s and sends the signal up
to that much early, so USR1 comes 29 to 59 s into each piece (after the ranks' start-up, 5 to 20 s here: a signal
before nanopt's handler would end them unsaved), and the limit's own SIGTERM at a later look, 30 s on at least.

Each training step here sleeps PAUSE_S (a sitecustomize on the job's PYTHONPATH): a piece of a run lasts as long
as SLURM's clock says, so the run must outlast one on any machine, and sleeping ranks leave the two cores to the
jobs that run beside them.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from clihelp import REPO, run_cli
from faulthelp import tiny_run
from slurmhelp import Cluster, SlurmMissing, slurm_cluster
from trainhelp import losses

from nanopt.rundir import RunDir

pytestmark = pytest.mark.slow  # a real scheduler and jobs of a minute each: ~3 minutes in all on 2 cores

STEPS, PAUSE_S = 240, 0.25  # ~65 s of training: longer than a piece of --time=1 can train
TRAIN = {"max_steps": STEPS, "checkpoint_interval": STEPS, "eval_interval": 0, "keep_checkpoints": 2}
RUN_S = 300  # a job of one piece, with room for a machine under load: only against a hung job
PIECES_S = 600  # a job in pieces: each waits CRED_EXPIRE_S to start again, and trains 10-55 s
TIME_LIMIT = ["--time=1", "--signal=B:USR1@1"]

PACE = """\
import os, time
if os.environ.get("SLURM_PROCID") == "0":
    time.sleep(float(os.environ.get("NANOPT_TEST_RANK0_LATE_S") or 0))
PAUSE_S = float(os.environ.get("NANOPT_TEST_STEP_PAUSE_S") or 0)
if PAUSE_S:
    from nanopt.data.loaders.loader import TrainLoader
    _next_batch = TrainLoader.next_batch

    def next_batch(self):
        if self.micro_step == 0:
            time.sleep(PAUSE_S)
        return _next_batch(self)

    TrainLoader.next_batch = next_batch
"""


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("slurm")
    (root / "pace").mkdir()
    (root / "pace" / "sitecustomize.py").write_text(PACE)
    try:
        with slurm_cluster(root) as running:
            yield running
    except SlurmMissing as exc:
        pytest.skip(f"no SLURM of the test's own here: {exc}")


def job_script(run: Path, *options: str) -> Path:
    """`nanopt slurm RUN` for two CPU ranks on this one node; the script it wrote."""
    done = run_cli("slurm", run, "--nodes", "1", "--gpus-per-node", "2", "--cpu", *options)
    assert done.returncode == 0, done.stderr
    assert shlex.split(done.stdout) == ["sbatch", str(run.resolve() / "slurm.sbatch")]
    return run / "slurm.sbatch"


def submit(cluster: Cluster, script: Path, *options: str, pause_s: float = PAUSE_S, rank0_late_s: float = 0) -> str:
    env = {"PYTHONPATH": str(cluster.root / "pace"), "NANOPT_TEST_STEP_PAUSE_S": str(pause_s),
           "NANOPT_TEST_RANK0_LATE_S": str(rank0_late_s)}
    return cluster.sbatch(*options, str(script), env=env)


def steps_logged(run: Path) -> int:
    """The last step in metrics.jsonl so far; its last line may be half written."""
    path, steps = run / "metrics.jsonl", [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            steps += [record["step"]] if record.get("kind") == "train" else []
    return max(steps)


def scaled_signal(script: Path) -> str:
    """The script's own --signal, its lead cut to TIME_LIMIT's."""
    own = re.search(r"^#SBATCH (--signal=\S+)$", script.read_text(), re.M)
    assert own, script.read_text()
    return re.sub(r"@\d+$", "@" + TIME_LIMIT[1].rsplit("@", 1)[1], own[1])


@dataclass(frozen=True)
class Submitted:
    run: Path
    script: Path
    job_id: str


@dataclass(frozen=True)
class Runs:
    reference: Submitted
    requeued: Submitted
    limited: Submitted
    requeued_at: int  # the step logged when scontrol requeued the job


@pytest.fixture(scope="module")
def runs(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> Runs:
    """Three runs of the same training, submitted side by side: one left alone (the reference), one requeued with
    scontrol at a random step, one under a one-minute limit. The limited one starts first, so its ranks are up
    before the others' start-up takes the cores, well before its USR1 (29 s at the earliest)."""
    root = tmp_path_factory.mktemp("runs")
    made = {name: tiny_run(root, tiny_dataset, name, **TRAIN) for name in ("reference", "requeued", "limited")}
    scripts = {name: job_script(run) for name, run in made.items()}
    jobs = {"limited": submit(cluster, scripts["limited"], TIME_LIMIT[0], scaled_signal(scripts["limited"]))}
    cluster.wait_for("the limited run's first step", lambda: steps_logged(made["limited"]) > 0, RUN_S,
                     jobs["limited"])
    jobs |= {name: submit(cluster, scripts[name]) for name in ("reference", "requeued")}
    at = random.randint(10, STEPS * 3 // 4)
    cluster.wait_for(f"step {at} of the run to requeue", lambda: steps_logged(made["requeued"]) >= at, RUN_S,
                     jobs["requeued"])
    cluster.run("scontrol", "requeue", jobs["requeued"])
    return Runs(*(Submitted(made[name], scripts[name], jobs[name]) for name in ("reference", "requeued", "limited")),
                requeued_at=at)


def assert_same_losses(cluster: Cluster, ours: Path, runs: Runs, report: str) -> None:
    """The losses of `ours` are the reference's at every step, once the reference is done."""
    cluster.wait(runs.reference.job_id, RUN_S)
    got, expected = losses(ours), losses(runs.reference.run)
    assert sorted(expected) == list(range(1, STEPS + 1)), report
    differ = [step for step in expected if got.get(step) != expected[step]]
    first = differ[0] if differ else None
    assert not differ, f"losses differ from step {first} on: {got.get(first)} != {expected.get(first)}\n{report}"


def saved_world_size(run: Path) -> int:
    latest = (RunDir(run).checkpoints / "latest").read_text().strip()
    return json.loads((RunDir(run).checkpoints / latest / "meta.json").read_text())["world_size"]


def test_a_generated_job_trains_the_run_to_the_end(cluster: Cluster, runs: Runs) -> None:
    run, job_id = runs.reference.run, runs.reference.job_id
    job = cluster.wait(job_id, RUN_S, max_restarts=0)
    report = cluster.report(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), report
    assert sorted(losses(run)) == list(range(1, STEPS + 1)), report
    assert saved_world_size(run) == 2, report  # two tasks of srun, two ranks
    assert cluster.output(job_id).count("nanopt-slurm: the run is complete") == 1, report


def test_a_finished_run_submitted_again_ends_completed_once(cluster: Cluster, runs: Runs) -> None:
    run = runs.reference.run
    cluster.wait(runs.reference.job_id, RUN_S, max_restarts=0)
    metrics = (run / "metrics.jsonl").read_bytes()
    job_id = submit(cluster, runs.reference.script, pause_s=0)
    job = cluster.wait(job_id, RUN_S, max_restarts=0)
    report = cluster.report(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "0"), report
    assert (run / "metrics.jsonl").read_bytes() == metrics, report  # not a step more
    assert "nanopt-slurm: the run is complete" in cluster.output(job_id), report


def test_a_requeue_at_a_random_moment_resumes_and_ends_with_the_same_losses(cluster: Cluster, runs: Runs) -> None:
    job_id = runs.requeued.job_id
    job = cluster.wait(job_id, PIECES_S, max_restarts=1)
    report = f"requeued at step {runs.requeued_at}\n{cluster.report(job_id)}"
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("COMPLETED", "0:0", "1"), report
    out = cluster.output(job_id)
    # SLURM's SIGTERM reached the ranks, which saved where they were (the run's only checkpoint before its end):
    # the second piece went on from there
    assert "received SIGTERM: finishing this step, saving a checkpoint" in out, report
    resumed = re.search(r"resumed from \S+ \(step (\d+)", out)
    assert resumed and int(resumed[1]) >= runs.requeued_at, report
    assert_same_losses(cluster, runs.requeued.run, runs, report)


def test_a_time_limit_shorter_than_the_run_requeues_it_until_it_is_done(cluster: Cluster, runs: Runs) -> None:
    job_id = runs.limited.job_id
    job = cluster.wait(job_id, PIECES_S, max_restarts=6)
    report = cluster.report(job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), report
    restarts = int(job["Restarts"])
    assert restarts >= 1, report  # the run outlasts a piece
    out = cluster.output(job_id)
    # each piece but the last ended by the script's USR1 with a checkpoint (the only ones: checkpoint_interval is
    # the run's length), and the script requeued it
    assert out.count("received SIGUSR1: finishing this step, saving a checkpoint") >= restarts, report
    assert out.count("nanopt-slurm: the run is unfinished and saved: requeued") == restarts, report
    assert_same_losses(cluster, runs.limited.run, runs, report)
    # The bill has every piece: each is a session of its own in metrics.jsonl's time records, its start-up included.
    records = [json.loads(line) for line in (runs.limited.run / "metrics.jsonl").read_text().splitlines()]
    sessions = {r["session_start"] for r in records if r.get("kind") == "phases"}
    assert len(sessions) == restarts + 1, report


def test_a_mistake_in_train_json_ends_the_job_once_with_its_one_line(cluster: Cluster, tmp_path: Path,
                                                                       tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "mistake", **TRAIN)
    script = job_script(run)
    train = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**train, "warmup_steps": -3}))  # edited after the script was made
    # Rank 0 starts late, as one rank does on a busy node: rank 1 meets the mistake first, and srun stops rank 0.
    job_id = submit(cluster, script, pause_s=0, rank0_late_s=5)
    job = cluster.wait(job_id, RUN_S, max_restarts=0)
    report = cluster.report(job_id)
    assert (job["JobState"], job["ExitCode"], job["Restarts"]) == ("FAILED", "2:0", "0"), report
    out = cluster.output(job_id)
    # each task of srun is a rank on its own, which says what it met: rank 1's one line, and rank 0's if it got there
    errors = [line for line in out.splitlines() if "warmup_steps" in line]
    assert errors and len({re.sub(r"^error: (rank \d+: )?", "", line) for line in errors}) == 1, report
    assert "must not be negative, got -3. Hint:" in errors[0], report
    assert "Traceback" not in out, report
    assert "nanopt-slurm: not requeued: a mistake to fix" in out, report


def test_scancel_stops_the_run_for_good_with_a_checkpoint(cluster: Cluster, tmp_path: Path,
                                                          tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "cancelled", **TRAIN)
    job_id = submit(cluster, job_script(run))
    cluster.wait_for("the first step", lambda: steps_logged(run) > 0, RUN_S, job_id)
    cluster.run("scancel", job_id)
    job = cluster.wait(job_id, RUN_S, max_restarts=0)
    report = cluster.report(job_id)
    assert job["JobState"] == "CANCELLED", report
    assert "received SIGTERM: finishing this step, saving a checkpoint" in cluster.output(job_id), report
    assert (RunDir(run).checkpoints / "latest").exists(), report  # `sbatch` the script again to go on


def test_a_run_directory_with_a_space_is_one_sbatch_takes(cluster: Cluster, tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "run x", **TRAIN)
    job_id = cluster.sbatch("--hold", str(job_script(run)))  # held: what sbatch read is the point, not a training
    job = cluster.job(job_id)
    cluster.run("scancel", job_id)
    assert (job["JobName"], job["StdOut"]) == ("nanopt-run x", f"{run.resolve()}/slurm-{job_id}.out"), job


PROBE = ("import os, sys; from nanopt.slurm import slurm_job, slurm_layout; job = slurm_job(os.environ); "
         "print(sys.argv[1], job and slurm_layout(job).describe(), flush=True)")


def test_nanopt_reads_the_layout_of_its_own_srun_step(cluster: Cluster, tmp_path: Path) -> None:
    """The batch script has SLURM_PROCID=0 and the job's task counts too, but is no task; a step of one task in a
    job of two per node is one rank."""
    python = shlex.join([sys.executable, "-c", PROBE])
    script = tmp_path / "probe.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1 --ntasks-per-node=2\n{python} batch\nsrun {python} tasks\n"
                      f"srun --ntasks=1 {python} one\n")
    job_id = cluster.sbatch(f"--output={tmp_path}/probe.out", f"--chdir={REPO}", str(script))
    job = cluster.wait(job_id, RUN_S, max_restarts=0)
    report = cluster.report(job_id)
    assert job["JobState"] == "COMPLETED", report
    gave = f"SLURM job {job_id} gave 1 node ({job['NodeList']}) x"
    assert sorted(cluster.output(job_id).splitlines()) == [
        "batch None", f"one {gave} 1 GPU process = 1 rank", *[f"tasks {gave} 2 task(s), one per rank = 2 ranks"] * 2
    ], report


