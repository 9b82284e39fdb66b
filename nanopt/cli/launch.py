"""The one torchrun launcher: `--nproc-per-node N` (and `--nnodes`) on train, eval, find-batch and profile.

torchrun runs inside this process (so a SIGTERM from a scheduler reaches it directly and it passes the signal on
to every rank), on the same nanopt command without the launcher options, and this process exits with what the
ranks meant: 0 done, 2 a user error (the rank that met it printed one line), STOPPED_EARLY after a SIGTERM /
SIGINT, 1 with one line naming the rank that failed (or saying that the nodes never all met); never torchrun's own
traceback and failure table.

With `--max-restarts N` (train) torchrun's agent stops and restarts every worker of the node after a failure that a
restart may get past (a rank killed or crashed, or cut off from a dead peer), up to N times; the restarted ranks
resume from the newest checkpoint as any `nanopt train` does. Each restart is one line here. A rank's own verdict
(a mistake to fix, a preemption, failed checks) is never restarted: it would only come again. The exit statuses
above apply once no restart is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from rich.markup import escape

from nanopt.cli.app import QUIET_LIBRARY_ENV, console
from nanopt.cli.rank_errors import ERROR_DIR_ENV, RankError, collected, lines_to_print
from nanopt.errors import ConfigError
from nanopt.parsing import check_option
from nanopt.runtime import under_torchrun
from nanopt.slurm import SlurmLayout, slurm_job, slurm_layout

# Exit status of a run stopped by SIGTERM / SIGINT before its end, its state saved (EX_TEMPFAIL: try again). Not 0,
# so a job scheduler or retry loop does not take a preempted run for a finished one.
STOPPED_EARLY = 75

# Exit status of `nanopt preflight` when one of its checks failed: the command's own verdict, printed by rank 0, not
# a crash; a script runs `nanopt preflight runs/x && nanopt train runs/x`.
CHECKS_FAILED = 3

LAUNCHER_OPTIONS = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--max-restarts"}

# The exit statuses that are a rank's own verdict rather than an accident: a restart would meet them again.
VERDICTS = {2, STOPPED_EARLY, CHECKS_FAILED}


# Far past any real node (8 GPUs today) and cluster: a value past them is a typo, and would start that many processes.
MAX_PROCS_PER_NODE = 1024
MAX_NODES = 100_000
MAX_RESTARTS = 1000  # each restart reloads the newest checkpoint: a failure that recurs this often needs a person


def launch_if_asked(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None,
                    max_restarts: int = 0) -> None:
    """Return at once in a single process or inside a torchrun worker; otherwise run torchrun and exit. One process
    with --max-restarts runs under torchrun too: its agent is what restarts it.

    The launcher options are checked first: a count below 1 would otherwise quietly run one process, and a node
    rank outside the nodes would wait for a rendezvous that never completes."""
    check_launcher_options(nproc_per_node, nnodes, node_rank, endpoint, max_restarts)
    if (nproc_per_node * nnodes > 1 or max_restarts) and not under_torchrun():
        run_torchrun(nproc_per_node, nnodes, node_rank, endpoint, max_restarts)


def slurm_launcher(explicit: bool, environ: dict[str, str] | os._Environ = os.environ) -> SlurmLayout | None:
    """The layout SLURM gave this task of `srun`, or None: outside srun, inside a rank that a launcher started (its
    WORLD_SIZE set), or when the command line names the layout itself (`explicit`), which then wins. A task that is
    one rank gets torchrun's variables here, so the rest of nanopt sees a rank as under torchrun."""
    if explicit or "WORLD_SIZE" in environ:
        return None
    job = slurm_job(environ)
    if job is None:
        return None
    layout = slurm_layout(job)
    environ.update(layout.rank_env)
    return layout


@contextlib.contextmanager
def slurm_named(layout: SlurmLayout | None) -> Iterator[None]:
    """A layout mistake (train.json's batch does not split over the ranks) said with what SLURM gave: the numbers
    came from the job's allocation, not from an option on the command line."""
    try:
        yield
    except ConfigError as exc:
        if layout is None:
            raise
        raise ConfigError(f"{layout.describe()}, but {exc.message}",
                          f"{exc.hint}; or ask SLURM for a GPU count the batch splits over (sbatch --nodes, "
                          "--gpus-per-node)".lstrip("; ")) from None


def check_launcher_options(nproc_per_node: int, nnodes: int, node_rank: int, endpoint: str | None = None,
                           max_restarts: int = 0) -> None:
    check_option("--nproc-per-node", nproc_per_node, 1, MAX_PROCS_PER_NODE, "processes on this node, usually its "
                 "GPU count, e.g. --nproc-per-node 8")
    check_option("--nnodes", nnodes, 1, MAX_NODES, "the number of machines in the run, e.g. --nnodes 2")
    check_option("--node-rank", node_rank, 0, nnodes - 1, f"this machine's place among the {nnodes} node(s): 0 on "
                 "the first, 1 on the second, ...")
    check_option("--max-restarts", max_restarts, 0, MAX_RESTARTS, "how many times torchrun may restart the ranks "
                 "after one fails, each resuming from the newest checkpoint, e.g. --max-restarts 3 (0: never)")
    _check_endpoint(nnodes, endpoint)


def _check_endpoint(nnodes: int, endpoint: str | None) -> None:
    """Every node names the same HOST:PORT, the first node's; without it each node would wait for the others alone,
    until the rendezvous times out."""
    hint = ("the first node's address and a free port, the same on every node, e.g. --rdzv-endpoint head:29500 "
            "(on one machine: localhost:29500)")
    if endpoint is None:
        if nnodes > 1:
            raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT", hint)
        return
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--rdzv-endpoint: {endpoint!r} is not HOST:PORT with a port in [1, 65535]", hint)


def run_torchrun(nproc: int, nnodes: int, node_rank: int, endpoint: str | None, max_restarts: int = 0) -> NoReturn:
    with _torch_cpp_errors_off():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError
        from torch.distributed.run import main as torchrun_main

    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if nnodes > 1 or endpoint:
        args += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    else:
        args.append("--standalone")
    _quiet_torchrun_logs()
    if max_restarts:
        # By default the ranks of every attempt share one store with torchrun's agent, where the keys the previous
        # attempt's process group left behind (its ranks' addresses) are read as the new one's, so a restarted
        # rank connects to a dead peer (pytorch/pytorch#135712). A store of its own per attempt avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    with tempfile.TemporaryDirectory(prefix="nanopt-errors-") as folder, _restarts_reported(Path(folder)):
        os.environ[ERROR_DIR_ENV] = folder  # the workers inherit it (see nanopt.cli.rank_errors)
        # The command's own arguments follow a `--`: otherwise torchrun's parser reads options such as --start or
        # --max as abbreviations of its own (--start-method, --max-restarts) and stops.
        started = time.monotonic()
        # SLURM's pre-limit USR1 (sbatch --signal=USR1@SECONDS) would end this process at once; torchrun's agent
        # passes SIGTERM on to the ranks, which then save and stop as for a preemption.
        signal.signal(signal.SIGUSR1, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
        try:
            torchrun_main(args + ["-m", "nanopt", "--", *strip_launcher_options(sys.argv[1:])])
        except SignalException as exc:  # torchrun passed the signal on to every rank and waited for them
            console(stderr=True).print(f"stopped by {signal.Signals(exc.sigval).name}: run the same command again "
                                       "to continue from the newest checkpoint", soft_wrap=True, markup=False)
            sys.exit(STOPPED_EARLY)
        except ChildFailedError as exc:
            _print_rank_errors(Path(folder))
            sys.exit(_failure_status(exc.failures, collected(Path(folder))))
        except RendezvousError as exc:  # raised in this process, before any rank of the attempt started
            _rendezvous_failed(exc, nnodes, endpoint, time.monotonic() - started)
            sys.exit(1)
    sys.exit(0)


def _rendezvous_failed(exc: Exception, nnodes: int, endpoint: str | None, seconds: float) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    if isinstance(exc, RendezvousConnectionError):  # this node could not reach the store at the endpoint
        cause = (str(exc.__cause__ or exc).strip().splitlines() or [type(exc).__name__])[0]
        _error(f"--nnodes {nnodes}: could not reach the rendezvous at {endpoint} (gave up after {seconds:.0f} s: "
               f"{cause.rstrip('.')})",
               "start the first node (--node-rank 0) too, and check that this machine reaches its HOST:PORT (the "
               "name resolves, the port is not firewalled); the wait is torchrun's read_timeout (60 s unless "
               "PET_RDZV_CONF=read_timeout=SECONDS); complete checkpoints are kept")
        return
    what = ("not every node joined in time" if isinstance(exc, RendezvousTimeoutError)
            else f"{type(exc).__name__}: {exc}".rstrip(": "))
    _error(f"--nnodes {nnodes}: the rendezvous at {endpoint or 'this machine'} failed ({what})",
           "start the same command on every node, each with its own --node-rank and the first node's "
           "HOST:PORT, reachable from the others, as --rdzv-endpoint; complete checkpoints are kept")


@contextlib.contextmanager
def _torch_cpp_errors_off() -> Iterator[None]:
    """Import torch with its C++ log at FATAL in this process: torch reads TORCH_CPP_LOG_LEVEL once, when it is
    imported, and here (torchrun's agent, which only joins the rendezvous and watches the ranks) its C++ errors are
    the agent's retries to reach an endpoint, each with a stack of C++ frames, before the one line nanopt prints.
    The ranks keep the level they were given (the variable is put back before they start), and a level the person
    chose is left alone."""
    name = "TORCH_CPP_LOG_LEVEL"
    level = os.environ.get(name)
    if "torch" in sys.modules or level not in (None, QUIET_LIBRARY_ENV[name]):
        yield
        return
    os.environ[name] = "FATAL"
    try:
        yield
    finally:
        if level is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = level


def _print_rank_errors(folder: Path) -> None:
    for line in lines_to_print(collected(folder)):
        console(stderr=True).print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)


def _quiet_torchrun_logs() -> None:
    """torchrun logs every failed or signalled worker and a banner; the ranks and `_failure_status` say it in
    one line. Set LOGLEVEL to see torchrun's own logs."""
    if "LOGLEVEL" in os.environ:
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _failure_status(failures: dict[int, Any], errors: list[RankError]) -> int:
    if any(e.crashed for e in errors):  # its line, printed above, names the rank; the others only lost it
        return 1
    # Once one rank fails torchrun stops the others with SIGTERM: those are not news.
    codes = {f.exitcode for f in failures.values()} - {-signal.SIGTERM}
    if codes and codes <= VERDICTS:  # the ranks' own reports, printed above, say why
        return max(codes)
    rank, failure = _culprit(failures)
    oom = " (SIGKILL is often the out-of-memory killer: see `dmesg`)" if failure.exitcode == -signal.SIGKILL else ""
    _error(f"{_what_happened(rank, failure)}, so torchrun stopped the others",
           f"complete checkpoints are kept: fix the cause{oom} and run the same command to resume")
    return 1


def _culprit(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that explains the others: a rank killed by a signal, or one that crashed, is why the others lost
    contact (their status 2 says so) or were stopped by torchrun (SIGTERM)."""
    return min(failures.items(), key=lambda item: (item[1].exitcode in (2, -signal.SIGTERM), item[1].exitcode >= 0,
                                                    item[0]))


def _what_happened(rank: int, failure: Any) -> str:
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
    return f"rank {rank} (pid {failure.pid}) {how}"


def _restart_cause(failures: dict[int, Any], errors: list[RankError]) -> str:
    """What a restart line blames: a rank's crash as it reported it (torchrun may have stopped that rank with
    SIGTERM while it was leaving, which is not what happened to it), else the failure that explains the others."""
    crash = next((e for e in errors if e.crashed), None)
    if crash is None:
        return _what_happened(*_culprit(failures))
    pid = f" (pid {failures[crash.rank].pid})" if crash.rank in failures else ""
    return f"rank {crash.rank}{pid} {crash.line.split(' (the traceback')[0]}"


def worth_a_restart(failures: dict[int, Any], errors: list[RankError]) -> bool:
    """Whether restarting the ranks may get past this failure: a rank was killed or crashed, or every rank that
    failed only lost contact (the cause is on another node). A rank's own verdict (a mistake to fix, a
    preemption, failed checks) would only come again, and cost a restart's start-up each time."""
    if any(e.crashed for e in errors):
        return True
    lost_contact = {e.rank for e in errors if e.lost_contact}
    causes = [f.exitcode for rank, f in failures.items() if f.exitcode != -signal.SIGTERM and rank not in lost_contact]
    return not causes or not set(causes) <= VERDICTS


@contextlib.contextmanager
def _restarts_reported(error_dir: Path) -> Iterator[None]:
    """While torchrun runs: each restart of its agent is one line naming the failure, a failure that a restart
    cannot get past is not restarted, and each attempt's rank errors are its own.

    torchrun builds its agent, a LocalElasticAgent, in torch.distributed.launcher.api and restarts the workers
    without a word; the agent below is that one, observing the two steps SimpleElasticAgent leaves to its
    subclasses (monitoring, restarting) and otherwise unchanged."""
    import torch.distributed.launcher.api as launcher_api

    base = launcher_api.LocalElasticAgent

    class ReportingAgent(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.failures: dict[int, Any] = {}  # the last attempt's, by global rank; {} while it is healthy

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            self.failures = result.failures if result.is_failed() else {}
            if self.failures and not worth_a_restart(self.failures, collected(error_dir)):
                self._remaining_restarts = 0  # the agent then stops, and the launcher reports as without restarts
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            if self.failures:  # else the membership changed: a node joined, and every node starts again with it
                attempt = worker_group.spec.max_restarts - self._remaining_restarts
                what = _restart_cause(self.failures, collected(error_dir))
                _say(f"restart {attempt} of {worker_group.spec.max_restarts} after {what}: every rank starts "
                     "again from the newest checkpoint")
            for path in error_dir.glob("*.json"):  # the failed attempt's reports: a later failure writes its own
                path.unlink(missing_ok=True)
            self.failures = {}
            super()._restart_workers(worker_group)

    launcher_api.LocalElasticAgent = ReportingAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


def _say(line: str) -> None:
    console(stderr=True).print(line, soft_wrap=True, markup=False)


def _error(message: str, hint: str) -> None:
    console(stderr=True).print(f"[bold red]error:[/] {escape(message)}. Hint: {escape(hint)}", soft_wrap=True)


def strip_launcher_options(argv: list[str]) -> list[str]:
    """The command line without the launcher's own options, as each rank runs it."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in LAUNCHER_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
