"""torch's intra-op threads on the CPU: how many, chosen from the cores this process may use and other work leaves
free (nanopt.hardware counts them), or the person's own OMP_NUM_THREADS / MKL_NUM_THREADS, and why, said once at the
start. On a shared 2-core machine torch's default of every core ran 3-8x slower than one thread.

nanopt.runtime applies it when a process starts on the CPU (init_runtime, runtime_on).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanopt.hardware import CPUCores

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch's own settings of its thread count, in its order
SAMPLE_S = 0.25  # how long the CPUs' busy time is sampled: ~25 clock ticks per CPU, long enough to see a busy loop
# A core counts as free while other work takes under a quarter of it: a shell, a monitoring agent, the kernel's own
# threads. Past that an OpenMP thread on it falls behind, and every other thread waits for it at each operator's end.
FREE_SLACK = 0.25


@dataclass(frozen=True)
class CPUThreads:
    """torch's intra-op threads on the CPU, and why: `chosen` by nanopt from the cores free at the start (shared
    among the ranks on this machine), or the person's own OMP_NUM_THREADS / MKL_NUM_THREADS."""

    threads: int
    reason: str  # the start-up line's parenthesis
    chosen: bool
    ranks: int = 1  # ranks on this machine sharing its cores
    variable: str | None = None  # the variable the person set, when not chosen

    def line(self) -> str:
        """'CPU: 2 threads (2 cores free of 4; OMP_NUM_THREADS to choose)': said once, at the start."""
        per = " per rank" if self.ranks > 1 else ""
        return f"CPU: {self.threads} thread{'s' if self.threads != 1 else ''}{per} ({self.reason})"

    def record(self) -> dict[str, Any]:
        return {"threads": self.threads, "chosen": self.chosen, "ranks": self.ranks, "reason": self.reason}


def set_cpu_threads(environ: Mapping[str, str] | None = None) -> CPUThreads:
    """Give torch the intra-op threads `choose_cpu_threads` decides, and return the decision. The person's own
    setting is applied again: torch reads the variables once, when imported, which may have been before they were
    set (a process that imports torch and then sets the environment for its work, as a fork server does)."""
    import torch

    from nanopt.hardware import cpu_cores, other_work

    environ = os.environ if environ is None else environ
    own = thread_setting(environ)
    cores = cpu_cores()
    # One thread waits on no other: with the person's 1 (the tests', torchrun's) the sample would only cost time.
    wanted = own is None or own[1] > 1
    busy = other_work(cores.cpus, SAMPLE_S) if wanted else None
    decision = choose_cpu_threads(cores, busy, own, local_ranks(environ))
    torch.set_num_threads(decision.threads)
    return decision


def thread_setting(environ: Mapping[str, str], parent_environ: Path | None = None) -> tuple[str, int] | None:
    """The person's own thread count: (variable, threads) of the first of THREAD_VARIABLES set to a whole number
    of at least 1 (an OpenMP list "4,2" gives its first), as torch reads them. torchrun's own OMP_NUM_THREADS=1,
    which it sets for several ranks when the person set none, is not the person's: their choice shows in the
    environment the ranks' parent (torchrun, or nanopt's launcher running it) started with."""
    for name in THREAD_VARIABLES:
        threads = _whole_number(environ.get(name, "").split(",")[0])
        if threads is None:
            continue
        if name == "OMP_NUM_THREADS" and threads == 1 and _set_by_torchrun(environ, parent_environ):
            continue
        return name, threads
    return None


def _whole_number(text: str) -> int | None:
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def _set_by_torchrun(environ: Mapping[str, str], parent_environ: Path | None = None) -> bool:
    """Whether OMP_NUM_THREADS=1 is torchrun's default: a rank of several on this machine, whose parent started
    without OMP_NUM_THREADS. Where that cannot be read, it is taken as the person's."""
    if "TORCHELASTIC_RUN_ID" not in environ or local_ranks(environ) < 2:
        return False
    path = parent_environ or Path(f"/proc/{os.getppid()}/environ")
    try:
        # The environment the parent was started with (/proc shows that, not what it set since: torchrun's own).
        variables = path.read_bytes().split(b"\0")
    except OSError:
        return False
    return not any(v.startswith(b"OMP_NUM_THREADS=") for v in variables)


def local_ranks(environ: Mapping[str, str]) -> int:
    """The ranks on this machine (torchrun's LOCAL_WORLD_SIZE), which share its cores; 1 outside torchrun."""
    return _whole_number(environ.get("LOCAL_WORLD_SIZE", "1")) or 1


def choose_cpu_threads(cores: CPUCores, busy: float | None, own: tuple[str, int] | None,
                       ranks: int = 1) -> CPUThreads:
    """The intra-op threads for one rank of `ranks` on this machine: the person's own setting (`own`), said with
    a warning when other work (`busy`, in CPUs, nanopt.hardware.other_work) leaves fewer cores free than threads
    asked for; else the cores free, shared among the ranks. A core shared with other work costs more than it gives:
    each operator waits for its slowest thread, and an OpenMP thread that spins for a busy core takes its time
    from the other work too (3-8x slower than one thread on the project's busy 2-core machine)."""
    if busy is None:
        free = cores.usable
    else:
        # Free logical CPUs, in physical cores where two hardware threads share one.
        free_cpus = max(0.0, len(cores.cpus) - busy)
        free = min(cores.usable, math.floor(free_cpus * cores.physical / max(1, len(cores.cpus)) + FREE_SLACK))
    limit = _limit(cores)
    if own is not None:
        name, threads = own
        crowded = busy is not None and threads * ranks > max(1, free)
        warning = (f", though {_count(free, 'core')} of {cores.usable} {'is' if free <= 1 else 'are'} free: fewer "
                   "threads would wait less" if crowded else "")
        return CPUThreads(threads=threads, reason=f"{name}={threads}{warning}{limit}", chosen=False, ranks=ranks,
                          variable=name)
    shared = f" shared by {ranks} ranks" if ranks > 1 else ""
    if busy is None:
        what = f"{_count(cores.usable, 'core')}{shared}, how busy unknown: no /proc/stat"
    else:
        what = f"{_count(free, 'core')} free of {cores.usable}{shared}"
        if free < cores.usable:
            what += ", other work busy on " + ("the rest" if free else "it" if cores.usable == 1 else "them all")
    return CPUThreads(threads=max(1, free // ranks), reason=f"{what}{limit}; OMP_NUM_THREADS to choose",
                      chosen=True, ranks=ranks)


def recorded_threads(recorded: Any) -> int | None:
    """The thread count a measurement was made with, as a record keeps it (CPUThreads.record()'s dict, or the bare
    count); None when it is not said or not a count, as in a record from a stranger."""
    threads = recorded.get("threads") if isinstance(recorded, dict) else recorded
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 else None


def other_threads(recorded: Any, threads: int | None) -> int | None:
    """The thread count a measurement was made with (as recorded_threads reads it) when it differs from `threads`,
    the count of the process it would stand for: such a measurement does not. None when they agree or either is
    not known."""
    measured_with = recorded_threads(recorded)
    return measured_with if None not in (threads, measured_with) and measured_with != threads else None


def _count(n: int, noun: str) -> str:
    return f"no {noun}" if n <= 0 else f"{n} {noun}{'s' if n != 1 else ''}"


def _limit(cores: CPUCores) -> str:
    """Why this process may use fewer cores than the machine has: its container's quota or its affinity mask."""
    if cores.quota is not None and math.floor(cores.quota) < min(cores.physical, len(cores.cpus)):
        return f"; CPU quota {cores.quota:g} of {cores.machine} CPUs"
    if len(cores.cpus) < cores.machine:
        return f"; affinity: {len(cores.cpus)} of {cores.machine} CPUs"
    return ""
