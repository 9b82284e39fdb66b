"""Past one node, through nanopt's own launcher: two `nanopt train --nnodes 2 --node-rank {0,1}` commands on this
machine (c10d rendezvous on a free localhost port) train exactly as one node of four ranks; and `--max-restarts`
lets torchrun restart the ranks after a worker is killed, which then resume from the newest checkpoint by
themselves.

The launchers are real processes (cold `python -m nanopt`, or forked from the warm launcher of tests/faulthelp.py),
their workers real torchrun workers. The uninterrupted runs they are compared with are the same library `train` on
warm gloo ranks (tests/distributed.py), which keeps four ranks on two cores affordable. A killed rank without
--max-restarts is tested in tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from clihelp import REPO, assert_user_error
from distributed import free_port, run_ranks
from faulthelp import HANG_GUARD_S, Child, Launcher, tiny_run, tree_digest
from trainhelp import HIDE_CUDA, final_weights_hash, losses

from nanopt.rundir import RunDir
from nanopt.train.guard.lock import RunLock

# Four ranks of micro-batch 2 x 16 tokens: one micro-step each, no accumulation. Few steps: eight cold workers
# share two cores.
FOUR_RANKS = {"global_batch_tokens": 128, "max_steps": 6, "checkpoint_interval": 6, "eval_interval": 0}


def train_in_rank(run: Path) -> dict[str, Any]:
    """What `nanopt train RUN` does in each torchrun worker, without the CLI: the run's summary."""
    from nanopt.config import load_run
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run), TrainOptions())


def start_train(run: Path, *args: str) -> subprocess.Popen:
    # CPU ranks with gloo, as the launcher's commands: a 1-GPU host has no cuda:1 for a node's second rank.
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", **HIDE_CUDA}
    return subprocess.Popen([sys.executable, "-m", "nanopt", "train", str(run), "--no-live", *args], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(job: subprocess.Popen) -> str:
    """The job's stderr once it has exited; a job still running at the guard is killed with its workers."""
    try:
        return job.communicate(timeout=HANG_GUARD_S)[1]
    except subprocess.TimeoutExpired:
        for child in psutil.Process(job.pid).children(recursive=True):
            child.kill()
        job.kill()
        raise AssertionError(f"a node did not end within {HANG_GUARD_S} s: {job.communicate()[1][-3000:]}") from None


def assert_losses_close(a: dict[int, float], b: dict[int, float], tol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst = max(abs(a[s] - b[s]) for s in a)
    assert worst <= tol, f"largest per-step loss difference {worst}"


@pytest.mark.slow  # four cold torchrun workers: ~25 s of CPU
def test_two_nodes_of_two_ranks_train_as_one_node_of_four(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    nodes = tiny_run(tmp_path, tiny_dataset, "nodes", **FOUR_RANKS)
    one_node = tiny_run(tmp_path, tiny_dataset, "one-node", **FOUR_RANKS)
    node_options = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"localhost:{free_port()}"]
    # Node 0 forked from the warm launcher, node 1 a cold process: two launchers, as on two machines.
    node0 = launcher.start("train", nodes, "--no-live", *node_options, "--node-rank", "0")
    node1 = start_train(nodes, *node_options, "--node-rank", "1")
    run_ranks(train_in_rank, one_node, world_size=4, env=HIDE_CUDA)
    err1 = finish(node1)
    launcher.wait(node0)
    assert (node0.status, node1.returncode) == (0, 0), node0.stderr[-2000:] + err1[-2000:]
    assert "Traceback" not in node0.stderr + err1
    assert_losses_close(losses(nodes), losses(one_node))
    assert sorted(losses(nodes)) == list(range(1, FOUR_RANKS["max_steps"] + 1))
    latest = (RunDir(nodes).checkpoints / "latest").read_text().strip()
    assert json.loads((RunDir(nodes).checkpoints / latest / "meta.json").read_text())["world_size"] == 4
    # One writer: rank 0 alone logs, so each step is in metrics.jsonl once, whichever node holds it.
    records = [json.loads(line) for line in RunDir(nodes).metrics.read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "train"]) == FOUR_RANKS["max_steps"]


# ------------------------------------------------------------------------------------------ elastic restarts

ELASTIC = {"max_steps": 12, "checkpoint_interval": 4, "eval_interval": 0}


def workers_of(job: Child, launcher: Launcher, count: int) -> list[psutil.Process]:
    """The training processes torchrun started under the launcher (each has RANK in its environment)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert not launcher.finished(job), job.stderr[-3000:]
        workers = []
        for child in psutil.Process(job.pid).children():
            try:  # between fork and exec a child still shows its parent's environment (no RANK yet)
                if "RANK" in child.environ():
                    workers.append(child)
            except psutil.Error:
                continue
        if len(workers) == count:
            return workers
        time.sleep(0.02)
    raise AssertionError(f"torchrun did not start {count} workers")


def wait_for_checkpoint(run: Path, alive: Any) -> None:
    latest = RunDir(run).checkpoints / "latest"
    deadline = time.monotonic() + HANG_GUARD_S
    while not latest.exists():
        assert alive() and time.monotonic() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.01)


def resume_events(run: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in RunDir(run).metrics.read_text().splitlines()]
    return [r for r in records if r["kind"] == "event" and r.get("event") == "resume"]


@pytest.mark.slow  # cold torchrun workers, twice: ~12 s of CPU per rank
def test_a_killed_worker_is_restarted_and_the_run_resumes_by_itself(tmp_path: Path, tiny_dataset: Path,
                                                                    launcher: Launcher):
    nproc = 2
    straight = tiny_run(tmp_path, tiny_dataset, "straight", **ELASTIC)
    elastic = tiny_run(tmp_path, tiny_dataset, "elastic", **ELASTIC)
    job = launcher.start("train", elastic, "--no-live", "--nproc-per-node", nproc, "--max-restarts", "1",
                         "--on-exit", "true")
    last = nproc - 1
    victim = next(w for w in workers_of(job, launcher, nproc) if w.environ()["RANK"] == str(last))
    wait_for_checkpoint(elastic, lambda: not launcher.finished(job))
    victim.send_signal(signal.SIGKILL)  # the out-of-memory killer, say
    # The uninterrupted run, while the restarted ranks train.
    run_ranks(train_in_rank, straight, world_size=nproc, env=HIDE_CUDA)
    assert launcher.wait(job) == 0, job.stderr[-3000:]
    assert f"restart 1 of 1 after rank {last} (pid {victim.pid}) was killed by SIGKILL" in job.stderr, job.stderr
    assert "Traceback" not in job.stderr and "error:" not in job.stderr
    resumed = resume_events(elastic)  # from the checkpoint the kill followed (4), or the next if the kill was slow
    assert len(resumed) == 1 and resumed[0]["step"] in (4, 8) and resumed[0]["restart"] == 1, resumed
    said = re.search(r"every rank starts again from the newest checkpoint\nresumed from \S+step-0*(\d+) ", job.stderr)
    assert said and int(said.group(1)) == resumed[0]["step"], job.stderr[-3000:]
    # The on-exit command runs once, at the run's end: not when rank 0 lost contact with the killed rank.
    assert re.findall(r"nanopt train ended: (\w+)", RunDir(elastic).exit_hook_log.read_text()) == ["completed"]
    assert losses(elastic) == losses(straight)
    assert final_weights_hash(elastic) == final_weights_hash(straight)


@pytest.mark.slow  # two cold torchrun workers: ~12 s of CPU
def test_a_mistake_is_not_restarted(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "locked", **ELASTIC)
    other = RunLock(run)  # another `nanopt train` of this run, as far as the ranks can tell: each restart would
    other.acquire()       # meet it again
    try:
        job = launcher.run("train", run, "--no-live", "--nproc-per-node", "2", "--max-restarts", "2")
    finally:
        other.release()
    assert_user_error(job, "is being trained by pid")  # that one line, and no restart


def test_a_node_whose_peers_never_come_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                   monkeypatch: pytest.MonkeyPatch):
    run = tiny_run(tmp_path, tiny_dataset, "alone")
    monkeypatch.setenv("PET_RDZV_CONF", "join_timeout=1")  # torchrun's own default for --rdzv-conf: wait 1 s, not 600
    endpoint = f"localhost:{free_port()}"
    result = cli_in_process("train", run, "--no-live", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", endpoint)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip() == (f"error: --nnodes 2: the rendezvous at {endpoint} failed (not every node joined "
                                      "in time). Hint: start the same command on every node, each with its own "
                                      "--node-rank and the first node's HOST:PORT, reachable from the others, as "
                                      "--rdzv-endpoint; complete checkpoints are kept")
    assert not RunDir(run).metrics.exists()


# --------------------------------------------------------------------------- launcher options refused at once


@pytest.mark.parametrize("options, fragments", [
    (["--max-restarts", "-1"], ["--max-restarts: -1 is outside [0, 1,000]", "e.g. --max-restarts 3"]),
    (["--nproc-per-node", "2", "--max-restarts", "1001"], ["--max-restarts: 1001 is outside [0, 1,000]"]),
    (["--nnodes", "2", "--node-rank", "1"], ["--nnodes 2 needs --rdzv-endpoint HOST:PORT", "the first node's"]),
    (["--nnodes", "2", "--rdzv-endpoint", "head"], ["--rdzv-endpoint: 'head' is not HOST:PORT"]),
    (["--nproc-per-node", "2", "--rdzv-endpoint", "head:99999"], ["'head:99999' is not HOST:PORT"]),
])
def test_a_bad_launcher_option_is_one_line_and_starts_nothing(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                              options: list[str], fragments: list[str]):
    run = tiny_run(tmp_path, tiny_dataset, "run")
    before = tree_digest(tmp_path)
    assert_user_error(cli_in_process("train", run, "--no-live", *options), *fragments)
    assert tree_digest(tmp_path) == before
