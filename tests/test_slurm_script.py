"""`nanopt slurm RUN`: the batch script it writes (its #SBATCH lines, time limit and pieces; bash accepts it), and
what that script does with each way a piece of the run ends, run by bash itself with srun and scontrol stood in
for by scripts that record what they were asked (the script's own logic is what is tested); and a training
stopped by the pre-limit USR1 saves and exits 75.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clihelp import REPO
from faulthelp import tiny_run
from trainhelp import HIDE_CUDA

from nanopt.errors import ConfigError
from nanopt.slurm_script import parse_time, plan_job, sbatch_lines

WRITE = [sys.executable, "-c", "import sys, nanopt.cli.commands.slurm; from nanopt.cli import main; "
         "sys.argv[0] = 'nanopt'; main()", "slurm"]


def nanopt_slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*WRITE, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "300"})


@pytest.fixture
def written(tmp_path: Path, tiny_dataset: Path) -> tuple[Path, subprocess.CompletedProcess]:
    run = tiny_run(tmp_path, tiny_dataset, "job")
    result = nanopt_slurm(str(run), "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu", "--account",
                          "proj", "--time", "04:00:00")
    assert result.returncode == 0, result.stderr
    return run, result


def test_the_script_asks_slurm_for_the_run_and_bash_accepts_it(written) -> None:
    run, result = written
    script = run / "slurm.sbatch"
    text = script.read_text()
    sbatch = re.findall(r"^#SBATCH (\S+)$", text, re.M)
    assert sbatch == ["--job-name=nanopt-job", "--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4",
                      "--time=04:00:00", "--signal=B:USR1@300", "--requeue", "--open-mode=append",
                      f"--output={run.resolve()}/slurm-%j.out", f"--error={run.resolve()}/slurm-%j.out",
                      "--partition=gpu", "--account=proj"]
    assert f"-m nanopt train {run.resolve()} --no-live" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    assert result.stdout.strip() == f"sbatch {script.resolve()}"


def test_without_time_the_limit_is_the_estimate_with_its_margin(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "estimated")
    assert nanopt_slurm(str(run), "--nodes", "1", "--gpus-per-node", "2", "--cpu").returncode == 0
    text = (run / "slurm.sbatch").read_text()
    assert "--time=00:11:00" in text  # seconds of training past start-up and the signal's lead, to the minute
    assert "--gpus-per-node" not in text and "--ntasks-per-node=2" in text


def test_a_long_run_is_split_into_pieces_of_the_given_time() -> None:
    plan = plan_job(Path("/r"), 4, 8, 10 * 3600, parse_time("04:00:00"))
    # 12 h with the margin; each piece trains 4 h less start-up and the signal's lead
    assert (plan.time_limit_s, plan.pieces, plan.max_requeues) == (4 * 3600, 4, 6)
    assert parse_time("1-00:00:00") == 86400 and parse_time("90") == 5400 and parse_time("30:00") == 1800


def test_a_value_with_a_space_is_quoted_as_sbatch_reads_it() -> None:
    """sbatch refuses a script whose #SBATCH line has a stray word (tests/test_slurm_cluster.py submits one)."""
    lines = sbatch_lines(plan_job(Path("/runs/run x"), 1, 2, 100, None, cpu=True))
    assert '#SBATCH --output="/runs/run x/slurm-%j.out"' in lines and '#SBATCH --job-name="nanopt-run x"' in lines
    with pytest.raises(ConfigError, match="double quote"):
        sbatch_lines(plan_job(Path('/runs/run "x'), 1, 2, 100, None, cpu=True))


@pytest.mark.parametrize(("args", "words"), [(["--time", "4h"], "--time '4h'"),
                                             (["--time", "00:05:00"], "leaves no time"),
                                             (["--nodes", "0"], "--nodes")])
def test_bad_options_are_one_line(tmp_path: Path, tiny_dataset: Path, args: list[str], words: str) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "bad")
    base = {"--nodes": "1", "--gpus-per-node": "1"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    result = nanopt_slurm(str(run), *[x for kv in base.items() for x in kv])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.stderr
    with pytest.raises(ConfigError):
        parse_time("12:xx")


# ------------------------------------------------------------------------------ what the script does at the end


def fake_slurm(tmp_path: Path, step: str) -> dict[str, str]:
    """srun runs `step` (a bash command) in place of the training; scontrol writes down its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\nexec bash -c {step!r}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "99"}


def requeued(tmp_path: Path) -> bool:
    log = tmp_path / "scontrol.log"
    return log.exists() and log.read_text().split() == ["requeue", "99"]


@pytest.mark.parametrize(("status", "restarts", "requeue"), [(0, 0, False), (2, 0, False), (75, 0, True),
                                                              (75, 50, True), (1, 0, True), (1, 5, False)])
def test_the_script_requeues_an_unfinished_run_only(written, tmp_path: Path, status: int, restarts: int,
                                                    requeue: bool) -> None:
    run, _ = written
    env = {**fake_slurm(tmp_path, f"exit {status}"), "SLURM_RESTART_COUNT": str(restarts)}
    done = subprocess.run(["bash", str(run / "slurm.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert requeued(tmp_path) == requeue, done.stdout
    assert done.returncode == (75 if requeue else status)


def fake_ranks(tmp_path: Path, *codes: int) -> dict[str, str]:
    """srun running the script's command as one task per code, each rank's training replaced by `exit CODE`
    (the wrapper that keeps its status is the script's own); srun's status the highest of them, as srun's is."""
    env = fake_slurm(tmp_path, "")
    ranks = " ".join(map(str, codes))
    (tmp_path / "bin" / "srun").write_text(
        f"#!/bin/bash\nshift\nhigh=0\nrank=0\nfor code in {ranks}; do\n"
        '  SLURM_PROCID=$rank "$1" "$2" "$3" "$4" bash -c "exit $code"; s=$?\n'
        "  [ $s -gt $high ] && high=$s; rank=$((rank + 1))\ndone\nexit $high\n")
    return env


@pytest.mark.parametrize(("codes", "requeue", "status"), [((2, 143), False, 2), ((1, 2), True, 75),
                                                           ((75, 75), True, 75), ((0, 0), False, 0)])
def test_the_ranks_own_statuses_decide_not_srun(written, tmp_path: Path, codes: tuple[int, ...], requeue: bool,
                                                status: int) -> None:
    """A mistake on rank 1 whose peer srun stopped (143) is a mistake; a crash whose peer lost contact (2) is a
    crash."""
    run, _ = written
    done = subprocess.run(["bash", str(run / "slurm.sbatch")], env=fake_ranks(tmp_path, *codes), capture_output=True,
                          text=True, timeout=30)
    assert (requeued(tmp_path), done.returncode) == (requeue, status), done.stdout + done.stderr
    assert not (run / ".slurm-ranks").exists()


def test_usr1_before_the_limit_stops_the_step_with_usr1_then_requeues(written, tmp_path: Path) -> None:
    run, _ = written
    # USR1, which srun passes on as it is; a SIGTERM it would turn into SIGKILL (tests/test_slurm_cluster.py)
    step = f"trap 'echo saved > {tmp_path}/saved; kill %1; exit 75' USR1; sleep 30 & wait"  # the sleep holds stdout
    script = subprocess.Popen(["bash", str(run / "slurm.sbatch")], env=fake_slurm(tmp_path, step),
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1)  # the step has set its trap
    script.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends, to the script alone
    out, _ = script.communicate(timeout=30)
    assert (tmp_path / "saved").exists() and requeued(tmp_path), out
    assert "nanopt-slurm: the time limit is near" in out and "unfinished and saved" in out


def test_a_job_slurm_ends_is_left_to_slurm(written, tmp_path: Path) -> None:
    """scancel, `scontrol requeue` and preemption send SIGTERM to the script and to the ranks, which save and exit
    75: a requeue from the script would bring back a job the user cancelled."""
    run, _ = written
    script = subprocess.Popen(["bash", str(run / "slurm.sbatch")], env=fake_slurm(tmp_path, "sleep 2; exit 75"),
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1)
    script.send_signal(signal.SIGTERM)
    out, _ = script.communicate(timeout=30)
    assert not requeued(tmp_path) and script.returncode == 75, out
    assert "not requeued by this script: SLURM ended the job" in out


def test_a_training_sent_usr1_saves_and_exits_75(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "usr1", max_steps=4000, checkpoint_interval=4000)
    job = subprocess.Popen([sys.executable, "-m", "nanopt", "train", str(run), "--no-live"], cwd=REPO,
                           env={**os.environ, **HIDE_CUDA, "PYTHONUNBUFFERED": "1"}, stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() or '"train"' not in (run / "metrics.jsonl").read_text():
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 75, err[-2000:]
    assert "received SIGUSR1: finishing this step, saving a checkpoint" in err
    assert (run / "checkpoints" / "latest").exists()


def test_a_link_where_the_script_goes_is_refused_and_its_target_left_alone(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "linked")
    target = tmp_path / "precious.txt"
    target.write_text("the user's own file\n")
    (run / "slurm.sbatch").symlink_to(target)
    result = nanopt_slurm(str(run), "--nodes", "1", "--gpus-per-node", "2", "--cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert target.read_text() == "the user's own file\n"
