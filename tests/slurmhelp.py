"""A real SLURM on this one machine, for tests/test_slurm_cluster.py: munged, slurmctld and slurmd of its own (their
ports, state, spool, logs, munge key and socket in a temporary folder, so a SLURM or munged already on the machine
is neither used nor disturbed), one partition of this host, and what a test needs to submit a job and wait for it.

Made for a container where we are root and there are no cgroups to use: processes are tracked by their parent
(proctrack/linuxproc), tasks are not bound (task/none), nothing is accounted. The partition lets jobs share the
host's CPUs (OverSubscribe=FORCE), so the test's jobs run side by side on two cores.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from distributed import free_port
from trainhelp import HIDE_CUDA

TOOLS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
START_GUARD_S = 60  # the daemons answer within seconds; past this they will not
CRED_EXPIRE_S = 10  # also how long a requeued job waits before it may start again (slurm.conf AuthInfo)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}

CONF = """\
ClusterName=nanopt-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MinJobAge=3600
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE OverSubscribe=FORCE:8 State=UP
"""


class SlurmMissing(Exception):
    """This machine cannot run a SLURM of its own; the message says what is missing."""


def missing() -> str | None:
    """What keeps a SLURM from running here, or None."""
    absent = [tool for tool in TOOLS if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
              is None]
    if absent:
        return (f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge, as .ci/run does when run as "
                "root)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and this test is not root"
    return None


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # SLURM_CONF, and no SLURM_* of a job this test may itself run in
    daemons: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr}{done.stdout}\n"
                                 f"{self.logs()}")
        return done.stdout

    def sbatch(self, *argv: str, env: dict[str, str] | None = None) -> str:
        """Submit; the job id. The job's environment is the test's and `env`, with no GPU, one thread per rank, and
        output unbuffered so a log read mid-run is current."""
        job_env = {**self.env, **HIDE_CUDA, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
                   **(env or {})}
        return self.run("sbatch", "--parsable", *argv, env=job_env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields: JobState, Restarts, ExitCode, StdOut, ... A name or path, which may hold
        spaces, has its line to itself (JobName the rest of the first)."""
        fields: dict[str, str] = {}
        for line in self.run("scontrol", "show", "job", job_id).splitlines():
            whole = re.match(r"\s*(?:JobId=(\S+) )?(JobName|Command|WorkDir|StdErr|StdIn|StdOut)=(.*)$", line)
            if whole:
                fields.update({"JobId": whole[1]} if whole[1] else {}, **{whole[2]: whole[3]})
            else:
                fields.update(re.findall(r"(\w+)=(\S*)", line))
        return fields

    def wait(self, job_id: str, timeout: float, max_restarts: int = 10) -> dict[str, str]:
        """The job once it has ended for good: not running, and not pending again after a requeue. A job requeued
        more often than `max_restarts` fails at once, rather than at the timeout: it came back when it should not."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if int(job.get("Restarts", "0")) > max_restarts:
                raise AssertionError(f"job {job_id} requeued {job['Restarts']} times, at most {max_restarts} "
                                     f"expected\n{self.report(job_id)}")
            if job.get("JobState") in ENDED:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {job.get('JobState')} after {timeout} s\n"
                                     f"{self.report(job_id)}")
            time.sleep(0.5)

    def wait_for(self, what: str, ready, timeout: float, job_id: str | None = None) -> None:
        """Poll `ready()` until true; on the timeout fail, saying `what` did not happen."""
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s\n"
                                     f"{self.report(job_id) if job_id else self.logs()}")
            time.sleep(0.2)

    def output(self, job_id: str) -> str:
        path = self.job(job_id).get("StdOut", "")
        return Path(path).read_text(errors="replace") if path and Path(path).is_file() else ""

    def report(self, job_id: str) -> str:
        """What a failure shows: the job as SLURM has it, its output file, the daemons' logs."""
        try:
            fields = self.run("scontrol", "show", "job", job_id, check=False)
            out = self.output(job_id)
        except Exception as exc:  # noqa: BLE001 (the report is for a failure already under way)
            fields, out = f"(scontrol failed: {exc})", ""
        return f"--- job {job_id}:\n{fields}\n--- its output:\n{out[-6000:]}\n{self.logs()}"

    def logs(self, lines: int = 40) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out", "munged.out"):
            path = self.root / name
            text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(none)"]
            out.append(f"--- {name} (last {lines} lines):\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel every job, then end the daemons and whatever our jobs left behind: nothing of this cluster runs
        after it."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 45  # KillWait (30 s) and the epilog
            while self.run("squeue", "--noheader", check=False).strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for daemon in reversed(self.daemons):
            _end(daemon)
        for pid in _processes_of(self.conf):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _end(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=20)


def _processes_of(conf: Path) -> list[int]:
    """Processes whose environment names this cluster's slurm.conf: slurmstepd and the jobs' processes, which
    slurmd starts detached from itself, so ending slurmd does not end them."""
    mark = f"SLURM_CONF={conf}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[Cluster]:
    """A SLURM of one node, up and idle; stopped on leaving, however that happens. SlurmMissing where it cannot
    start (its message has the daemons' logs)."""
    reason = missing()
    if reason:
        raise SlurmMissing(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"
    cluster = Cluster(root, {**env, "SLURM_CONF": str(root / "slurm.conf")})
    try:
        _start(cluster)
        yield cluster
    finally:
        cluster.stop()


def _start(cluster: Cluster) -> None:
    root = cluster.root
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))  # a key of its own: no other munged can speak for this cluster
    key.chmod(0o400)
    _daemon(cluster, "munged.out", "munged", "--foreground", "--force", f"--socket={root}/munge.socket",
            f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed")
    cluster.wait_for("munged's socket", (root / "munge.socket").exists, START_GUARD_S)
    host = socket.gethostname().split(".")[0]
    cluster.conf.write_text(CONF.format(host=host, root=root, ctld_port=free_port(), slurmd_port=free_port(),
                                        cpus=os.cpu_count() or 1, cred_expire=CRED_EXPIRE_S))
    _daemon(cluster, "slurmctld.out", "slurmctld", "-D", "-c")
    _daemon(cluster, "slurmd.out", "slurmd", "-D")
    try:
        cluster.wait_for("the node idle in sinfo", lambda: _idle(cluster), START_GUARD_S)
    except AssertionError as exc:
        raise SlurmMissing(f"SLURM did not start here: {exc}") from None


def _daemon(cluster: Cluster, log: str, *argv: str) -> None:
    with open(cluster.root / log, "wb") as out:
        daemon = subprocess.Popen(argv, env=cluster.env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    cluster.daemons.append(daemon)
    time.sleep(0.2)
    if daemon.poll() is not None:
        raise SlurmMissing(f"{argv[0]} exited {daemon.returncode} at start\n{cluster.logs()}")


def _idle(cluster: Cluster) -> bool:
    if any(d.poll() is not None for d in cluster.daemons):
        raise AssertionError(f"a daemon exited\n{cluster.logs()}")
    return cluster.run("sinfo", "--noheader", "--format=%t", check=False).strip() == "idle"
