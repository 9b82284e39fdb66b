"""What SLURM gave a task of `srun`: its job's nodes, and the ranks nanopt runs there.

Two ways to run under `srun`, told apart by the tasks per node:
- one task per node (`--ntasks-per-node 1`): each task is the node's launcher, as `--nproc-per-node` is: it starts
  one rank per GPU of the node (SLURM_GPUS_ON_NODE, 1 without GPUs) through torchrun, whose rendezvous is at the
  first node of the job;
- one task per GPU (`--ntasks-per-node G`): each task is one rank, its place from SLURM's task ids, and it joins
  the process group at the first node as torch.distributed's env:// does (MASTER_ADDR, MASTER_PORT).

Read only in a task of srun, which has a step id (SLURM_STEP_ID) besides its job's: the batch script itself, or an
`salloc` shell, has the job's variables (the batch script SLURM_PROCID=0 too) but is no task, and a nanopt started
there runs as anywhere else. The nodes and tasks are the step's (SLURM_STEP_*), which may be fewer than the job's:
`srun --ntasks 1` in a job of 8 tasks per node is one rank.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from nanopt.errors import ConfigError

# A port derived from the job id: two jobs whose first node is the same one would otherwise meet at one port.
PORT_BASE, PORT_SPAN = 20_000, 20_000


def expand_hostlist(hostlist: str) -> list[str]:
    """The hosts of a SLURM node list, in `scontrol show hostnames`' order: `node[01-03,07]`, `a[1-2],b3`,
    `rack[1-2]-n[1-2]` (each bracket a dimension). ConfigError for a list SLURM would refuse."""
    hosts: list[str] = []
    for part in _top_level_parts(hostlist):
        pieces = re.split(r"(\[[^\[\]]*\])", part)
        if not part or any("[" in p or "]" in p for p in pieces[::2]):
            raise _bad_list(hostlist, f"unmatched bracket or empty name in {part!r}")
        choices = [_numbers(p[1:-1], hostlist) if p.startswith("[") else [p] for p in pieces]
        hosts += ["".join(combo) for combo in product(*choices)]
    return hosts


def _top_level_parts(hostlist: str) -> list[str]:
    """`a[1,3],b` -> `a[1,3]`, `b`: the commas inside brackets belong to their range."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(hostlist[start:i])
            start = i + 1
    return [*parts, hostlist[start:]]


def _numbers(ranges: str, hostlist: str) -> list[str]:
    """`01-03,7` -> 01 02 03 7: zero padding to the width of each range's lower bound, as SLURM pads."""
    out: list[str] = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise _bad_list(hostlist, f"{item!r} is not a number or a range LOW-HIGH")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _bad_list(hostlist: str, why: str) -> ConfigError:
    return ConfigError(f"SLURM_JOB_NODELIST {hostlist!r}: {why}",
                       "run under sbatch / srun, which set it, or unset the SLURM_* variables")


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    hosts: tuple[str, ...]
    node_id: int  # SLURM_NODEID: this node's place in the job
    proc_id: int  # SLURM_PROCID: this task's place among all tasks
    local_id: int  # SLURM_LOCALID: this task's place on its node
    ntasks: int
    tasks_per_node: str  # SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE's compact form, e.g. "2(x3)"
    gpus_on_node: int  # SLURM_GPUS_ON_NODE; 0 without GPUs
    port: int


def slurm_job(environ: Mapping[str, str]) -> SlurmJob | None:
    """This task's job, or None outside a task of srun."""
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not (environ.get("SLURM_JOB_ID") and environ.get("SLURM_PROCID") and step_id):
        return None
    job_id = environ["SLURM_JOB_ID"]
    list_name = _first_set(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = expand_hostlist(environ.get(list_name, ""))
    count_name = _first_set(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES")
    nnodes = _number(environ, count_name, str(len(hosts)))
    if nnodes != len(hosts):
        raise ConfigError(f"{count_name} says {nnodes} nodes and {list_name} names {len(hosts)}",
                          "run under sbatch / srun, which set both, or unset the SLURM_* variables")
    default_port = PORT_BASE + int(job_id) % PORT_SPAN if job_id.isdigit() else PORT_BASE
    # SLURM_NTASKS_PER_NODE last: it is the job's --ntasks-per-node, which a step of fewer tasks inherits unchanged
    per_node = _first_set(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    return SlurmJob(job_id=job_id, hosts=tuple(hosts), node_id=_number(environ, "SLURM_NODEID", "0"),
                    proc_id=_number(environ, "SLURM_PROCID", "0"), local_id=_number(environ, "SLURM_LOCALID", "0"),
                    ntasks=_number(environ, _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), str(nnodes)),
                    tasks_per_node=environ.get(per_node, ""), gpus_on_node=_number(environ, "SLURM_GPUS_ON_NODE", "0"),
                    port=_number(environ, "MASTER_PORT", str(default_port)))


def _first_set(environ: Mapping[str, str], *names: str) -> str:
    """The first of `names` set (to something), else the last: the one a message names."""
    return next((name for name in names if environ.get(name)), names[-1])


def _number(environ: Mapping[str, str], name: str, default: str) -> int:
    value = environ.get(name) or default
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r} is not a whole number",
                          "run under sbatch / srun, which set it, or unset the SLURM_* variables")
    return int(value)


@dataclass(frozen=True)
class SlurmLayout:
    job: SlurmJob
    per_task: bool  # one rank per task (True) or one launcher per node (False)
    nproc_per_node: int

    @property
    def nnodes(self) -> int:
        return len(self.job.hosts)

    @property
    def node_rank(self) -> int:
        return self.job.node_id

    @property
    def port(self) -> int:
        return self.job.port

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def endpoint(self) -> str | None:
        """torchrun's rendezvous: the first node's; none on one node, where --standalone picks a free port."""
        return f"{self.job.hosts[0]}:{self.port}" if self.nnodes > 1 else None

    @property
    def rank_env(self) -> dict[str, str]:
        """torchrun's variables for a task that is one rank; {} for a task that starts the node's ranks."""
        if not self.per_task:
            return {}
        job = self.job
        return {"RANK": str(job.proc_id), "LOCAL_RANK": str(job.local_id), "WORLD_SIZE": str(job.ntasks),
                "LOCAL_WORLD_SIZE": str(self.nproc_per_node), "GROUP_RANK": str(job.node_id),
                "MASTER_ADDR": job.hosts[0], "MASTER_PORT": str(self.port)}

    def describe(self) -> str:
        hosts = ", ".join(self.job.hosts[:4]) + (", ..." if self.nnodes > 4 else "")
        what = "task(s), one per rank" if self.per_task else "GPU process" + ("es" if self.nproc_per_node > 1 else "")
        return (f"SLURM job {self.job.job_id} gave {self.nnodes} node{'s' if self.nnodes > 1 else ''} ({hosts}) x "
                f"{self.nproc_per_node} {what} = {self.world_size} rank{'s' if self.world_size > 1 else ''}")


def slurm_layout(job: SlurmJob) -> SlurmLayout:
    """One task per node or one per GPU, from the tasks SLURM started on each node; ConfigError, one line naming
    what SLURM gave, for a split nanopt cannot run (uneven nodes, more tasks than GPUs)."""
    per_node = _tasks_per_node(job)
    if per_node == 1:
        return SlurmLayout(job, per_task=False, nproc_per_node=max(job.gpus_on_node, 1))
    if job.gpus_on_node and per_node != job.gpus_on_node:
        raise ConfigError(f"SLURM job {job.job_id} runs {per_node} tasks per node on {job.gpus_on_node} GPUs per node"
                          ": nanopt runs one task per node (it starts the GPUs' ranks) or one task per GPU",
                          f"srun --ntasks-per-node 1 or --ntasks-per-node {job.gpus_on_node}")
    return SlurmLayout(job, per_task=True, nproc_per_node=per_node)


def _tasks_per_node(job: SlurmJob) -> int:
    counts = _expand_counts(job.tasks_per_node) if job.tasks_per_node else []
    nnodes = len(job.hosts)
    if len(counts) == 1:  # SLURM_NTASKS_PER_NODE, or every node alike
        counts *= nnodes
    if not counts and job.ntasks % nnodes == 0:
        counts = [job.ntasks // nnodes] * nnodes
    if len(set(counts)) != 1 or len(counts) != nnodes or sum(counts) != job.ntasks:
        given = job.tasks_per_node or f"{job.ntasks} tasks"
        raise ConfigError(f"SLURM job {job.job_id} gave {nnodes} nodes with tasks per node {given}: nanopt needs the "
                          "same number of tasks on every node", "sbatch / srun --ntasks-per-node N with --nodes")
    return counts[0]


def _expand_counts(compact: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's `2(x3),1` -> 2 2 2 1."""
    counts: list[int] = []
    for item in compact.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE {compact!r}: not SLURM's `N` or `N(xM)` list",
                              "run under sbatch / srun, which set it, or unset the SLURM_* variables")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts
