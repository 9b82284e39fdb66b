"""`nanopt train RUN` as a task of `srun`, with SLURM's variables as srun sets them and no launcher option: the
ranks come from the job, a layout train.json cannot run on is one line naming both, and an explicit option wins.

The SLURM variables are the ones srun gives each task (tests/test_slurm_env.py checks how they are read); a real
slurmctld runs the same command in tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clihelp import REPO, assert_user_error
from distributed import free_port
from faulthelp import tiny_run
from trainhelp import HIDE_CUDA, losses

from nanopt.rundir import RunDir

SHORT = {"max_steps": 4, "checkpoint_interval": 4, "eval_interval": 0}


def srun_task(run: Path, proc_id: int, ntasks: int, port: int, *args: str) -> subprocess.Popen:
    """One task of `srun --nodes 1 --ntasks-per-node NTASKS nanopt train RUN` on this machine."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "localhost",
             "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_PROCID": str(proc_id),
             "SLURM_LOCALID": str(proc_id), "SLURM_NTASKS": str(ntasks), "SLURM_TASKS_PER_NODE": str(ntasks),
             "MASTER_PORT": str(port)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update({"COLUMNS": "200", "PYTHONUNBUFFERED": "1", **HIDE_CUDA, **slurm})
    return subprocess.Popen([sys.executable, "-m", "nanopt", "train", str(run), "--no-live", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def world_size_saved(run: Path) -> int:
    latest = (RunDir(run).checkpoints / "latest").read_text().strip()
    return json.loads((RunDir(run).checkpoints / latest / "meta.json").read_text())["world_size"]


@pytest.mark.slow  # two cold processes joining one process group: ~15 s of CPU
def test_two_tasks_of_srun_are_two_ranks_without_options(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "tasks", **SHORT)
    port = free_port()
    tasks = [srun_task(run, rank, 2, port) for rank in range(2)]
    outcomes = [task.communicate(timeout=300) for task in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [err[-2000:] for _, err in outcomes]
    assert world_size_saved(run) == 2
    assert sorted(losses(run)) == list(range(1, SHORT["max_steps"] + 1))


def test_a_slurm_layout_the_batch_cannot_split_over_is_one_line(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "three", **SHORT)
    task = srun_task(run, 0, 3, free_port())
    out, err = task.communicate(timeout=120)
    result = subprocess.CompletedProcess(task.args, task.returncode, out, err)
    assert_user_error(result, "SLURM job 77 gave 1 node (localhost) x 3 task(s)", "global_batch_tokens")


def test_an_explicit_option_wins_over_slurm(tmp_path: Path, tiny_dataset: Path) -> None:
    run = tiny_run(tmp_path, tiny_dataset, "explicit", **SHORT)
    task = srun_task(run, 0, 3, free_port(), "--nproc-per-node", "1")  # 3 ranks would not split the batch
    _, err = task.communicate(timeout=120)
    assert task.returncode == 0, err[-2000:]
    assert world_size_saved(run) == 1
