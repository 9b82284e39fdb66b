"""Run a function on two (or more) gloo ranks from warm processes, set up exactly as torchrun sets up its workers,
and hand each rank's return value back to the test.

`nanopt ... --nproc-per-node 2` starts torchrun, which starts a cold `python -m nanopt` per rank: about 5 s of CPU
each just to import torch and nanopt before the first step. The ranks here are forked from a forkserver that has
imported them once per test process, so a two-rank test pays for its own work only. Use this where the launcher is
not what the test checks (DDP / FSDP numbers, uneven evaluation, ranks agreeing); the launcher, its signals and its
exit statuses are tested through the real CLI (tests/test_faults.py).

A rank's environment is the forkserver's (the test process's when the server started) plus torchrun's variables
and `env`; `nanopt.runtime.ranks()` reads them as it would under torchrun.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

HANG_GUARD_S = 120  # only against a hung test: a rank still running then fails the test; no assertion is about time
# Once a rank has failed, how long the others may take to end by themselves (most lose their peer and raise within a
# second) before they are stopped, as torchrun stops the other workers when one fails. Without it, a rank that failed
# before a collective left the others waiting in it until the hang guard: the test looked hung, not failed.
PEER_FAILED_GRACE_S = 30.0

# Imported once by the forkserver, so each rank starts from them (torch first: it is most of the import time).
PRELOAD = ["torch", "torch.distributed", "matplotlib.figure", "matplotlib.backends.backend_agg",
           "nanopt.train.loop", "nanopt.evaluate.report",
           "nanopt.plan.find_batch.finder", "nanopt.plan.find_batch.trials"]


class RankFailed(AssertionError):
    """A rank died or hung without a result; the message says which rank and how it ended."""


class RankTraceback(Exception):
    """The traceback of an exception raised in a rank, as text (set as the re-raised exception's cause)."""


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, env: dict[str, str] | None = None,
              timeout: float = HANG_GUARD_S, peer_failed_grace: float = PEER_FAILED_GRACE_S) -> list[Any]:
    """Call `fn(*args)` on `world_size` gloo ranks at once; the ranks' return values, in rank order.

    `fn` must be importable by name (a module-level function of a test module) and its arguments and result
    picklable. An exception in a rank is raised here again, the first rank's to fail (the others usually just lost
    their peer), with the rank's traceback as its cause; a rank that dies or outlives `timeout` fails the test. The
    ranks still running `peer_failed_grace` seconds after one failed are stopped, as torchrun stops them.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    # No effect once this process's forkserver runs: whoever starts it first decides, and find-batch's trial
    # processes (nanopt.plan.find_batch.trials, in-process find-batch commands) share the same server.
    ctx.set_forkserver_preload(PRELOAD)
    port = free_port()
    ranks, conns = [], []
    try:
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_rank_main, name=f"rank-{rank}",
                                  args=(fn, args, torchrun_env(rank, world_size, port, env), child_conn))
            process.start()
            child_conn.close()
            ranks.append(process)
            conns.append(parent_conn)
        outcomes = _collect(ranks, conns, timeout, peer_failed_grace)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
        for conn in conns:
            conn.close()
    failed = [rank for rank, outcome in outcomes.items() if outcome[0] != "ok"]  # in the order they ended
    if failed:  # the first rank to fail is the cause; the others usually only lost their peer
        _raise(failed[0], outcomes[failed[0]])
    return [outcomes[rank][1] for rank in range(world_size)]


def torchrun_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The variables torchrun gives a worker on a single node (torch.distributed.elastic's local agent)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "OMP_NUM_THREADS": "1",
            **(extra or {})}


def free_port() -> int:
    """A TCP port free right now on localhost, for rank 0's rendezvous store (as torchrun --standalone picks one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------- in a rank

_KEPT: list = []


def keep_until_exit(obj: Any) -> None:
    """Never free `obj` in this rank (it leaves through os._exit). For a DDP wrapper: freed, its Reducer's destructor
    joins gloo's worker thread while holding the GIL, which that thread may be waiting for, and the rank hangs."""
    _KEPT.append(obj)



def _rank_main(fn: Callable[..., Any], args: tuple, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)
    import torch

    # torchrun's OMP_NUM_THREADS=1, applied although the forkserver imported torch before it was set.
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        outcome = ("ok", fn(*args))
    except BaseException as exc:
        outcome = ("raised", _portable(exc), traceback.format_exc())
    try:
        conn.send(outcome)
    except Exception as exc:  # a result or exception that does not pickle: say so instead of dying silently
        conn.send(("raised", RuntimeError(f"the rank's outcome could not be sent: {exc}"), traceback.format_exc()))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # As nanopt's CLI leaves a torchrun worker: freeing a gloo process group in a destructor can hang the exit.
    os._exit(0)


def _portable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling (so a test can expect its type), else its type and text."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------- the parent


def _collect(ranks: list[Any], conns: list[Any], timeout: float, grace: float) -> dict[int, tuple]:
    """Each rank's outcome, in the order they arrived; a rank that ends without one, or hangs, is an outcome too."""
    outcomes: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    why_stopped = f"still running after {timeout:.0f} s (killed)"
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    while waiting:
        ready = wait([*waiting, *(ranks[rank].sentinel for rank in waiting.values())],
                     timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            for rank in waiting.values():
                outcomes[rank] = ("hung", why_stopped)
            break
        for conn, rank in list(waiting.items()):
            if conn in ready or ranks[rank].sentinel in ready:
                outcomes[rank] = _receive(conn, ranks[rank])
                del waiting[conn]
                if outcomes[rank][0] != "ok" and time.monotonic() + grace < deadline:
                    deadline = time.monotonic() + grace
                    why_stopped = f"still running {grace:.0f} s after rank {rank} failed (killed, as torchrun would)"
    return outcomes


def _receive(conn: Any, process: Any) -> tuple:
    try:
        return conn.recv()
    except EOFError:  # it ended without sending: killed, crashed, or left through os._exit inside `fn`
        process.join()
        return ("died", f"exited with status {process.exitcode} before returning")


def _raise(rank: int, outcome: tuple) -> None:
    if outcome[0] == "raised":
        _, exc, text = outcome
        raise exc from RankTraceback(f"in rank {rank}:\n{text}")
    raise RankFailed(f"rank {rank} {outcome[1]}")
