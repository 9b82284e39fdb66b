"""Processes: each step in a process of its own, forked from a parent that imported torch once and never touches
CUDA; `nanopt` commands inside a step, in its process or forked from it; and the count of what each of them
compiled (graphs and seconds, written beside the work), which the parent checks against the step's budget.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpusession.records import REPO

BENCH = REPO / "bench"
_graphs_dir: Path | None = None  # where this process and the nanopt processes it forks note what they compiled


def child_env() -> dict[str, str]:
    """This process's environment, with nanopt importable from the copied tree (no install needed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(BENCH), env.get("PYTHONPATH", "")) if p)
    return env


# ------------------------------------------------------------------------------------ what was compiled


def graph_state() -> tuple[int, float]:
    """(graphs Dynamo has compiled in this process, seconds it spent compiling, backward graphs included)."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0.0
    from torch._dynamo import utils

    try:
        seconds = float(utils.calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 (a private helper: a torch without it still counts graphs)
        seconds = 0.0
    return int(utils.counters["stats"]["unique_graphs"]), seconds


def note_process(label: str, start: tuple[int, float]) -> None:
    """Write what this process compiled since `start` (a fork inherits its parent's counters) and the TF32 setting
    it ran with, for the parent to add up."""
    if _graphs_dir is None:
        return
    graphs, seconds = graph_state()
    tf32 = None
    if "torch" in sys.modules:
        tf32 = sys.modules["torch"].backends.cuda.matmul.allow_tf32
    note = {"label": label, "pid": os.getpid(), "graphs": graphs - start[0],
            "compile_s": round(seconds - start[1], 2), "allow_tf32": tf32}
    _graphs_dir.mkdir(parents=True, exist_ok=True)
    (_graphs_dir / f"{os.getpid()}.json").write_text(json.dumps(note))


def notes_in(directory: Path) -> list[dict[str, Any]]:
    notes = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return notes


def labelled_note(label: str) -> dict[str, Any]:
    """The note of the last process this step started with `label` (start_nanopt), or {}."""
    notes = [n for n in notes_in(_graphs_dir) if n.get("label") == label] if _graphs_dir is not None else []
    return notes[-1] if notes else {}


def use_codeless_compile() -> None:
    """Smoke runs: every torch.compile in this process (and those it forks) uses Dynamo's `eager` backend, which
    captures the same graphs as Inductor without generating code: the graph count is real, the CPU time small."""
    import torch

    if not isinstance(torch.compile, functools.partial):
        torch.compile = functools.partial(torch.compile, backend="eager")


# ------------------------------------------------------------------------------------------- processes


def _fork() -> int:
    """os.fork without Python 3.12's warning about the one native thread torch's import starts: nothing the
    children need is locked by it (the fallback, should that ever change: --isolation spawn)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def forked(output: Path, work: Callable[[], None], new_session: bool = False) -> int:
    """`work()` in a forked child whose stdout and stderr append to `output`; returns the child's pid. The child
    exits with work's exit status (a traceback in `output` and status 1 when it raised); with `new_session` it
    leads a process group of its own, so killing the group ends everything it started."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = _fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler ends the session, not a step
        if new_session:
            os.setsid()
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        work()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 (reported through the exit status and the output)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_worker(step: str, graphs_dir: Path, smoke: bool, worker: Callable[[], None]) -> None:
    """A step's work in its own process, noting what it compiled however it ends."""
    global _graphs_dir
    _graphs_dir = graphs_dir
    if smoke:
        use_codeless_compile()
    start = graph_state()
    try:
        worker()
    finally:
        note_process(step, start)


def start_nanopt(args: list[str], output: Path, log_recompiles: bool = False, kill_at_batch: int | None = None,
                 label: str | None = None) -> int:
    """`nanopt ARGS` as a process of its own, forked from this one (no second torch import), its stdout and stderr
    into `output`; with `log_recompiles`, torch.compile's recompilations logged there (TORCH_LOGS=recompiles); with
    `kill_at_batch` N, the process sends itself SIGKILL when training asks for its Nth batch (a kill at a known
    step, with no race against a fast or a descheduled machine). Returns its pid. The calling process must not
    have touched CUDA yet (a forked child could not use it)."""
    print(f"$ {shlex.join(['nanopt', *args])}" + ("  (TORCH_LOGS=recompiles)" if log_recompiles else ""), flush=True)
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
        raise RuntimeError("a step forked `nanopt` after initializing CUDA (the child could not use the GPU): touch "
                           "the device only after a step's last fork (records.base_record does not)")

    def work() -> None:
        if kill_at_batch is not None:
            _kill_at_batch(kill_at_batch)
        if log_recompiles:
            import torch._logging

            torch._logging.set_logs(recompiles=True)
        from nanopt.cli import main as nanopt_main

        start = graph_state()
        try:
            nanopt_main(args)
        finally:
            note_process(label or args[0], start)

    return forked(output, work)


def _kill_at_batch(n: int) -> None:
    """In a forked child: SIGKILL this process when the training loader is asked for its nth batch."""
    from nanopt.data.loaders import loader

    original, calls = loader.TrainLoader.next_batch, [0]

    def next_batch(self: Any) -> Any:
        calls[0] += 1
        if calls[0] >= n:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    loader.TrainLoader.next_batch = next_batch


def fork_nanopt(args: list[str], output: Path, log_recompiles: bool = False, label: str | None = None
                ) -> tuple[int, str]:
    """start_nanopt, waited for: its exit status and its output (the tail also into session.log)."""
    output.unlink(missing_ok=True)
    pid = start_nanopt(args, output, log_recompiles, label=label)
    _, status = os.waitpid(pid, 0)
    text = output.read_text(errors="replace")
    print(text[-3000:], flush=True)
    return os.waitstatus_to_exitcode(status), text


def run_nanopt(*args: str) -> tuple[int, str]:
    """`nanopt ARGS` in this step's process (no second torch import): its exit status and stdout. Its stderr, and
    the tail of its stdout, go to session.log."""
    import contextlib
    import io

    from nanopt.cli import main as nanopt_main

    print(f"$ {shlex.join(['nanopt', *args])}", flush=True)
    stdout = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout):
        try:
            nanopt_main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    print(stdout.getvalue()[-2000:], flush=True)
    return code, stdout.getvalue()


# ------------------------------------------------------------------------------------------- the parent


def start_spawned(argv: list[str], log: Path) -> int:
    """A fresh interpreter (`--isolation spawn`), its own session, its output appended to `log`."""
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                env=child_env(), start_new_session=True).pid


def wait_for(pid: int, budget_s: float, poll: Callable[[], None] = lambda: None) -> int | None:
    """The child's exit status, or None when it was killed (with its whole group) at the end of its budget.
    `poll` runs every 50 ms meanwhile (the parent prints new records with it). Whatever interrupts the wait (the
    call's own timeout, as SIGTERM) kills the child's group first."""
    deadline = time.perf_counter() + budget_s
    try:
        while time.perf_counter() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            poll()
            time.sleep(0.05)
    except BaseException:
        kill_group(pid)
        raise
    kill_group(pid)
    return None


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # a forked child killed before its setsid() has no group of its own yet
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
