"""SLURM's environment read as `nanopt train` under `srun` reads it: the node list expanded as `scontrol show
hostnames` expands it, and the layout (one task per node or one per GPU) decided from the task counts.

The expected host lists are what `scontrol show hostnames` (Slurm 22.05, Debian's slurm-wlm) printed for each
form; where scontrol is installed the test asks it again, so a difference in another Slurm version shows here.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from nanopt.errors import ConfigError
from nanopt.slurm import expand_hostlist, slurm_job, slurm_layout

HOSTLISTS = {
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "a[1-2],b3": ["a1", "a2", "b3"],
    "rack[1-2]-node[01-02]": ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"],
    "node[8-11]": ["node8", "node9", "node10", "node11"],
    "node[098-101]": ["node098", "node099", "node100", "node101"],
    "n1,n[3-4],m[10-11]": ["n1", "n3", "n4", "m10", "m11"],
    "gpu-a100-[1-2],gpu-h100-01": ["gpu-a100-1", "gpu-a100-2", "gpu-h100-01"],
    "x[1,3-5],y": ["x1", "x3", "x4", "x5", "y"],
    "node[1-2]x[3-4]": ["node1x3", "node1x4", "node2x3", "node2x4"],
    "node[1-010]": [f"node{i}" for i in range(1, 11)],  # the width is the lower bound's
    "node[010-12]": ["node010", "node011", "node012"],
    "n[01,1,001]": ["n01", "n1", "n001"],
    "n[1-2],n2": ["n1", "n2", "n2"],
    "node7": ["node7"],
    "localhost": ["localhost"],
}


@pytest.mark.parametrize("hostlist", sorted(HOSTLISTS))
def test_node_lists_expand_as_scontrol_does(hostlist: str) -> None:
    assert expand_hostlist(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.parametrize("hostlist", sorted(HOSTLISTS))
def test_expected_lists_are_scontrols(hostlist: str, tmp_path) -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (apt-get install slurm-wlm): the lists above stand in for it")
    conf = tmp_path / "slurm.conf"  # scontrol reads a configuration before parsing, even offline
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p "
                    "Nodes=localhost Default=YES\n")
    out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, check=True,
                         env={**os.environ, "SLURM_CONF": str(conf)})
    assert out.stdout.split() == HOSTLISTS[hostlist]


@pytest.mark.parametrize("bad", ["n[3-1]", "n[a-b]", "n[1-3", "n1]", "n[]", ""])
def test_a_malformed_node_list_is_one_line(bad: str) -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(bad)


def _env(**extra: str) -> dict[str, str]:
    base = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0"}
    return {**base, **extra}


def test_no_slurm_without_a_job_and_a_task() -> None:
    assert slurm_job({}) is None
    assert slurm_job({"SLURM_JOB_ID": "1"}) is None  # inside salloc, not a task of srun
    batch_script = {k: v for k, v in _env(SLURM_PROCID="0").items() if k != "SLURM_STEP_ID"}
    assert slurm_job(batch_script) is None  # sbatch gives its script SLURM_PROCID=0, but no step
    assert slurm_job(_env()) is not None


def test_a_step_of_fewer_tasks_than_the_job_is_the_steps_ranks() -> None:
    """What `srun --nodes 1 --ntasks 1` gives its task in a job of two nodes and --ntasks-per-node=2 (Slurm 22.05):
    the step's own counts, and the job's --ntasks-per-node unchanged."""
    env = _env(SLURM_NODEID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="2",
               SLURM_TASKS_PER_NODE="1", SLURM_STEP_NODELIST="gpu07", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1")
    layout = slurm_layout(slurm_job(env))
    assert (layout.nnodes, layout.world_size, layout.endpoint) == (1, 1, None)


def test_one_task_per_node_starts_the_nodes_gpus() -> None:
    layout = slurm_layout(slurm_job(_env(SLURM_GPUS_ON_NODE="8", SLURM_TASKS_PER_NODE="1(x2)")))
    assert not layout.per_task
    assert (layout.nnodes, layout.nproc_per_node, layout.node_rank) == (2, 8, 1)
    assert layout.endpoint == f"gpu07:{layout.port}"
    assert layout.world_size == 16
    assert layout.rank_env == {}


def test_one_task_per_gpu_takes_its_rank_from_slurm() -> None:
    env = _env(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_GPUS_ON_NODE="4", SLURM_PROCID="6",
               SLURM_LOCALID="2")
    layout = slurm_layout(slurm_job(env))
    assert layout.per_task and layout.world_size == 8
    assert layout.rank_env == {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                               "GROUP_RANK": "1", "MASTER_ADDR": "gpu07", "MASTER_PORT": str(layout.port)}


def test_tasks_per_node_from_slurms_compact_form() -> None:
    layout = slurm_layout(slurm_job(_env(SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="2(x2)", SLURM_PROCID="3",
                                         SLURM_LOCALID="1")))
    assert layout.per_task and layout.rank_env["LOCAL_WORLD_SIZE"] == "2"


def test_the_port_is_the_jobs_own_and_a_set_one_wins() -> None:
    one, other = (slurm_layout(slurm_job(_env(SLURM_JOB_ID=job))) for job in ("4242", "4243"))
    assert one.port != other.port  # two jobs sharing a first node do not meet at the same port
    assert slurm_layout(slurm_job(_env(MASTER_PORT="29555"))).port == 29555


def test_single_node_has_no_endpoint() -> None:
    env = _env(SLURM_JOB_NODELIST="gpu07", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_NTASKS="1",
               SLURM_PROCID="0")
    layout = slurm_layout(slurm_job(env))
    assert (layout.nnodes, layout.endpoint) == (1, None)  # torchrun --standalone finds a free port itself


@pytest.mark.parametrize(("extra", "words"), [
    ({"SLURM_NTASKS": "3", "SLURM_TASKS_PER_NODE": "2,1"}, "2,1"),
    ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "2"}, "4 tasks per node"),
    ({"SLURM_JOB_NUM_NODES": "3"}, "3 nodes"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID"),
])
def test_a_layout_slurm_cannot_have_given_is_one_line(extra: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        slurm_layout(slurm_job(_env(**extra)))


def test_describe_names_what_slurm_gave() -> None:
    layout = slurm_layout(slurm_job(_env(SLURM_GPUS_ON_NODE="8")))
    assert layout.describe() == "SLURM job 4242 gave 2 nodes (gpu07, gpu08) x 8 GPU processes = 16 ranks"
