"""Helpers for the fault and user-error tests: a warm launcher for `nanopt` commands, a tiny run, and a digest of
a directory tree.

The launcher forks each command from a process that has already imported torch and nanopt (as a fork server does)
and calls the same entry point as `python -m nanopt`. A test that restarts `nanopt train` dozens of times then
spends its time on training and faults instead of a 3 s import per start. Each command is a real process with its
own signals, file descriptors, resource limits and exit status; its stdout and stderr go to files.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from clihelp import REPO
from trainhelp import device_env, make_run, world_size_of

HANG_GUARD_S = 120  # only against a hung test; no assertion is about time
TINY_MODEL = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 16}
# 40 steps with a checkpoint every 2, so kills land in and around checkpoint writes; eval every 20 exercises the
# `best` pointer and loss.png writes too. 1 rank: accumulation 2; 2 ranks: accumulation 1.
TINY_TRAIN = {"micro_batch_size": 2, "global_batch_tokens": 64, "max_steps": 40, "checkpoint_interval": 2,
              "keep_checkpoints": 3, "eval_interval": 20, "eval_tokens": 256, "warmup_steps": 3}


def tiny_run(root: Path, dataset: Path, name: str, **train) -> Path:
    """A run directory with a model small enough that 40 steps take about a second on a CPU."""
    return make_run(root, dataset, name, model=TINY_MODEL, **{**TINY_TRAIN, **train})


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under `path` with its sha256, or {} when it does not exist: to show nothing was written."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}

LAUNCHER = r"""
import json, os, resource, signal, sys, traceback
import matplotlib.backends.backend_agg, matplotlib.figure  # noqa: F401  (loss.png)
import nanopt.cli, nanopt.train.loop  # noqa: F401  (what every child would import again)
import torch._dynamo  # noqa: F401  (imported by the optimizer's first construction: ~2 s of CPU in every child)
import importlib
# Imported on first use by every `nanopt train` (typer's option parsing pulls in pydantic): ~0.1-0.2 s per child.
# A name that moves is skipped: the children import what they need themselves.
for name in ("typer._adapters", "nanopt.data.loaders.loader", "nanopt.model.transformer",
             "nanopt.train.guard.exit_hook", "PIL.PngImagePlugin"):
    try:
        importlib.import_module(name)
    except ImportError:
        pass


# SIGKILL this process as the training loader hands out step `step`'s first batch, once `latest` in `checkpoints`
# names `latest`: a kill at a known point, however fast the steps are (a GPU's take milliseconds).
def kill_at_step(step, checkpoints, latest):
    import time
    from pathlib import Path
    from nanopt.data.loaders.loader import TrainLoader
    from nanopt.train.checkpoint import read_pointer

    original = TrainLoader.next_batch

    def next_batch(self):
        if self.step + 1 >= step and self.micro_step == 0:
            deadline = time.monotonic() + 60  # the background save publishes meanwhile (a thread of its own)
            while read_pointer(Path(checkpoints), "latest") != latest and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    TrainLoader.next_batch = next_batch


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if request.get("fsize"):  # a disk that refuses writes past this size: EFBIG instead of SIGXFSZ
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (request["fsize"], request["fsize"]))
        os.environ.update(request.get("env") or {})  # this command's own variables (torchrun's ranks inherit them)
        if request.get("kill_at_step"):
            kill_at_step(**request["kill_at_step"])
        sys.argv = ["nanopt", *request["argv"]]
        code = 0
        try:
            nanopt.cli.main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def _read_if_any(path: Path) -> str:
    """A child killed between fork and opening its output files (a kill "while starting") wrote nothing."""
    return path.read_text() if path.exists() else ""


@dataclass
class Child:
    pid: int
    out: Path
    err: Path
    status: int | None = None

    @property
    def stderr(self) -> str:
        return _read_if_any(self.err)

    @property
    def stdout(self) -> str:
        return _read_if_any(self.out)

    @property
    def returncode(self) -> int | None:
        """The exit status under subprocess's name, so clihelp.assert_user_error reads a child as a result."""
        return self.status


class Launcher:
    """Forks one `nanopt` command at a time from the warm process and reports its exit status."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        # One thread per process, as torchrun gives each rank: a model this small runs several times faster so,
        # and two threads per run would contend with the test and other jobs for two cores.
        env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._next()["ready"]
        self.count = 0
        self.current: Child | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def _next(self, timeout: float = HANG_GUARD_S) -> dict:
        return self.lines.get(timeout=timeout)

    def start(self, *argv: object, fsize: int | None = None, env: dict[str, str] | None = None,
              gpu: bool = False, kill_at_step: dict | None = None) -> Child:
        """Fork `nanopt ARGV`; `env` adds to (or overrides) the launcher's environment for this command only.
        The command sees no GPU (CPU numbers, as the tests expect) unless `gpu` asks for one and the host has a GPU
        per rank (trainhelp.device_env); the launcher never initializes CUDA, so the forked command decides.
        `kill_at_step` ({"step": N, "checkpoints": DIR, "latest": NAME}): the command SIGKILLs itself as training
        reads step N's first batch, once DIR's `latest` names NAME (LAUNCHER's kill_at_step)."""
        self._end_leftover()
        self.count += 1
        child = Child(0, self.logs / f"{self.count}.out", self.logs / f"{self.count}.err")
        args = [str(a) for a in argv]
        request = {"argv": args, "stdout": str(child.out), "stderr": str(child.err), "fsize": fsize,
                   "env": {**device_env(world_size_of(args), gpu), **(env or {})}, "kill_at_step": kill_at_step}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        child.pid = self._next()["pid"]
        self.current = child
        return child

    def _end_leftover(self) -> None:
        """End a child that a failed test started and never waited for: the launcher forks one command at a time,
        and the next test must not read that child's exit status as its own."""
        leftover = self.current
        if leftover is not None and not self.finished(leftover):
            try:
                os.kill(leftover.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait(leftover)

    def finished(self, child: Child) -> bool:
        """Whether the child has exited (without waiting)."""
        if child.status is None:
            try:
                child.status = self.lines.get_nowait()["status"]
            except queue.Empty:
                return False
        return True

    def wait(self, child: Child, timeout: float = HANG_GUARD_S) -> int:
        if child.status is None:
            try:
                child.status = self._next(timeout)["status"]
            except queue.Empty:  # hung: end it, then fail with what it said
                os.kill(child.pid, signal.SIGKILL)
                child.status = self._next()["status"]
                raise AssertionError(f"the nanopt process {child.pid} did not end within {timeout} s; stderr:\n"
                                     f"{child.stderr[-3000:]}") from None
        return child.status

    def run(self, *argv: object, fsize: int | None = None, env: dict[str, str] | None = None,
            gpu: bool = False) -> Child:
        child = self.start(*argv, fsize=fsize, env=env, gpu=gpu)
        self.wait(child)
        return child

    def train(self, run: Path, *args: str, env: dict[str, str] | None = None, gpu: bool = False) -> Child:
        child = self.run("train", run, "--no-live", *args, env=env, gpu=gpu)
        assert child.status == 0, child.stderr[-3000:]
        return child

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
