"""The one torchrun launcher: `--nproc-per-node N` (and `--nnodes`) on train, eval, find-batch and profile.

torchrun runs inside this process (so a SIGTERM from a scheduler reaches it directly and it passes the signal on
to every rank), on the same nanopt command without the launcher options, and this process exits with what the
ranks meant: 0 done, 2 a user error (the rank that met it printed one line), STOPPED_EARLY after a SIGTERM /
SIGINT, 1 with one line naming the rank that failed; never torchrun's own traceback and failure table.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from rich.markup import escape

from nanopt.cli.app import console
from nanopt.cli.rank_errors import ERROR_DIR_ENV, collected, lines_to_print
from nanopt.parsing import check_option
from nanopt.runtime import under_torchrun

# Exit status of a run stopped by SIGTERM / SIGINT before its end, its state saved (EX_TEMPFAIL: try again). Not 0,
# so a job scheduler or retry loop does not take a preempted run for a finished one.
STOPPED_EARLY = 75

# Exit status of `nanopt preflight` when one of its checks failed: the command's own verdict, printed by rank 0, not
# a crash; a script runs `nanopt preflight runs/x && nanopt train runs/x`.
CHECKS_FAILED = 3

LAUNCHER_OPTIONS = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint"}


# Far past any real node (8 GPUs today) and cluster: a value past them is a typo, and would start that many processes.
MAX_PROCS_PER_NODE = 1024
MAX_NODES = 100_000


def launch_if_asked(nproc_per_node: int, nnodes: int = 1, node_rank: int = 0, endpoint: str | None = None) -> None:
    """Return at once in a single process or inside a torchrun worker; otherwise run torchrun and exit.

    The launcher options are checked first: a count below 1 would otherwise quietly run one process, and a node
    rank outside the nodes would wait for a rendezvous that never completes."""
    check_launcher_options(nproc_per_node, nnodes, node_rank)
    if nproc_per_node * nnodes > 1 and not under_torchrun():
        run_torchrun(nproc_per_node, nnodes, node_rank, endpoint)


def check_launcher_options(nproc_per_node: int, nnodes: int, node_rank: int) -> None:
    check_option("--nproc-per-node", nproc_per_node, 1, MAX_PROCS_PER_NODE, "processes on this node, usually its "
                 "GPU count, e.g. --nproc-per-node 8")
    check_option("--nnodes", nnodes, 1, MAX_NODES, "the number of machines in the run, e.g. --nnodes 2")
    check_option("--node-rank", node_rank, 0, nnodes - 1, f"this machine's place among the {nnodes} node(s): 0 on "
                 "the first, 1 on the second, ...")


def run_torchrun(nproc: int, nnodes: int, node_rank: int, endpoint: str | None) -> NoReturn:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if nnodes > 1 or endpoint:
        args += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint or 'localhost:29500'}"]
    else:
        args.append("--standalone")
    _quiet_torchrun_logs()
    with tempfile.TemporaryDirectory(prefix="nanopt-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder  # the workers inherit it (see nanopt.cli.rank_errors)
        # The command's own arguments follow a `--`: otherwise torchrun's parser reads options such as --start or
        # --max as abbreviations of its own (--start-method, --max-restarts) and stops.
        try:
            torchrun_main(args + ["-m", "nanopt", "--", *strip_launcher_options(sys.argv[1:])])
        except SignalException as exc:  # torchrun passed the signal on to every rank and waited for them
            console(stderr=True).print(f"stopped by {signal.Signals(exc.sigval).name}: run the same command again "
                                       "to continue from the newest checkpoint", soft_wrap=True, markup=False)
            sys.exit(STOPPED_EARLY)
        except ChildFailedError as exc:
            _print_rank_errors(Path(folder))
            sys.exit(_failure_status(exc.failures))
    sys.exit(0)


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


def _failure_status(failures: dict[int, Any]) -> int:
    # Once one rank fails torchrun stops the others with SIGTERM: those are not news.
    codes = {f.exitcode for f in failures.values()} - {-signal.SIGTERM}
    if codes and codes <= {2, STOPPED_EARLY, CHECKS_FAILED}:  # the ranks' own reports, printed above, say why
        return max(codes)
    # A rank killed by a signal, or one that crashed, is why the others lost contact (their status 2 says so).
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode in (2, -signal.SIGTERM),
                                                             item[1].exitcode >= 0, item[0]))
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
    oom = " (SIGKILL is often the out-of-memory killer: see `dmesg`)" if failure.exitcode == -signal.SIGKILL else ""
    _error(f"rank {rank} (pid {failure.pid}) {how}, so torchrun stopped the others",
           f"complete checkpoints are kept: fix the cause{oom} and run the same command to resume")
    return 1


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
