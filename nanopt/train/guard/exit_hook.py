"""The on-exit hook: a shell command run once when `nanopt train` ends, whatever the reason (train.json `on_exit`,
`nanopt train --on-exit`): to shut a rented machine down or send a message, so an ended run stops costing money.

The command runs through the shell in a session of its own, its stdin /dev/null, its output appended to the run's
on_exit.log, with the reason and what is known of the run's end in NANOPT_* environment variables. It is bounded by
train.json `on_exit_timeout_s`: past that its whole process group is killed. Nothing here raises or prints: whatever
becomes of the command (it fails, is missing, hangs, the log cannot be written) is a HookResult for the CLI to
report in one line, and the run's exit status and files never depend on it. The CLI decides where it runs (rank 0,
never torchrun's launcher process) and with which exit status.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from nanopt.errors import NanoptError, WritePathError
from nanopt.files import open_file
from nanopt.rundir import RunDir
from nanopt.train.guard.lock import RunLocked

REASONS = ("completed", "preempted", "diverged", "error", "interrupted", "crashed")

# What torchrun puts in a worker's environment. The hook runs in a plain shell: a `nanopt eval` (or any torch
# program) it starts must not take itself for rank 0 of the run that just ended and wait for ranks that are gone.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_ENV_PREFIX = "TORCHELASTIC_"

# After the timeout: SIGTERM to the command's process group, this long to end, then SIGKILL to what is left of it.
KILL_GRACE_S = 2.0
SHOWN_COMMAND_CHARS = 60  # a long command is cut in the one-line report (the log holds it whole)

# on_exit.log keeps the first this many bytes of each run of the command, then one line counting the rest: a command
# that prints without end (`yes`, a loop) must not fill the disk the run directory is on.
LOG_CAP_BYTES = 8 << 20
# The command's output goes through a pipe to this little shell program, in a session of its own, which appends to
# on_exit.log. Not a thread of nanopt: a background job the command leaves running may print after nanopt has
# exited, and must not be killed by SIGPIPE for it (it was not when its output went straight to the log).
_CAPPER = ('head -c "$1"; rest=$(wc -c | tr -d " "); [ "$rest" = 0 ] || '
           'printf "\\n%s\\n" "[nanopt: $rest more bytes of output dropped; on_exit.log keeps the first $1 bytes of '
           'each run]"')


def exit_reason(error: BaseException | None, completed: bool = True) -> str:
    """Why `nanopt train` ended: the error it is leaving with (None: it returned a summary, `completed` or not)."""
    if error is None:
        return "completed" if completed else "preempted"  # an incomplete summary: stopped by SIGTERM / SIGINT, saved
    if _diverged(error):
        return "diverged"
    if isinstance(error, NanoptError):
        return "error"
    if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C / SIGINT: stopped at once, without saving
        return "interrupted"
    return "crashed"


def _diverged(error: BaseException) -> bool:
    # TrainingDiverged lives beside the step, which imports torch: an error raised before that module was imported
    # (a bad config) cannot be one, and need not wait seconds for torch to say so.
    step = sys.modules.get("nanopt.train.step")
    return step is not None and isinstance(error, step.TrainingDiverged)


def ends_the_run(error: BaseException | None) -> bool:
    """Whether this `nanopt train` ending is its run's end. One refused because another process is training the run
    is not: that one runs the hook when it ends, and a shutdown now would cut its training short."""
    return not isinstance(error, RunLocked)


def error_message(error: BaseException | None) -> str | None:
    """NANOPT_EXIT_MESSAGE: a nanopt error's one line as the CLI prints it, else the exception's first line."""
    if error is None or isinstance(error, KeyboardInterrupt):
        return None
    if isinstance(error, NanoptError):
        return error.one_line()
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


@dataclass(frozen=True)
class ExitDetails:
    """What is known of the run's end, for the command's environment."""

    exit_status: int  # the status `nanopt train` exits with
    step: int | None = None  # the step the run reached, when it returned a summary
    total_steps: int | None = None  # the run's budget in steps, once its config was read
    message: str | None = None  # the error's one line


@dataclass(frozen=True)
class HookResult:
    """What became of the command. `exit_code` is the shell's status (negative: killed by that signal), None when it
    did not start, timed out or was stopped by Ctrl-C."""

    command: str
    reason: str
    seconds: float
    timeout_s: float
    exit_code: int | None = None
    timed_out: bool = False
    stopped: bool = False
    start_error: str | None = None
    log: Path | None = None  # where its output went; None when the log could not be opened
    log_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.log_error is None

    def describe(self) -> str:
        """One line: the command, what became of it, and where its output is."""
        shown = self.command if len(self.command) <= SHOWN_COMMAND_CHARS else self.command[:SHOWN_COMMAND_CHARS] + "..."
        where = f" (output in {self.log})" if self.log is not None else ""
        unlogged = f"; its output was not logged: {self.log_error}" if self.log_error else ""
        return f'"{shown}" {self.outcome()}{where}{unlogged}'

    def outcome(self) -> str:
        if self.start_error is not None:
            return f"could not start: {self.start_error}"
        if self.timed_out:
            return (f"timed out after {self.timeout_s:g} s (on_exit_timeout_s) and was killed with every process it "
                    "started")
        if self.stopped:
            return f"was stopped by Ctrl-C after {self.seconds:.1f} s, with every process it started"
        if self.exit_code is not None and self.exit_code < 0:
            return f"was killed by {signal.Signals(-self.exit_code).name} after {self.seconds:.1f} s"
        meaning = {126: " (not executable)", 127: " (command not found)"}.get(self.exit_code, "")
        return f"exited {self.exit_code}{meaning} after {self.seconds:.1f} s"


def hook_environment(reason: str, run_dir: Path, details: ExitDetails) -> dict[str, str]:
    """This process's environment without torchrun's variables, with the NANOPT_* ones that describe the end."""
    env = {name: value for name, value in os.environ.items()
           if name not in TORCHRUN_ENV and not name.startswith(TORCHRUN_ENV_PREFIX)}
    known = {"NANOPT_EXIT_REASON": reason, "NANOPT_RUN_DIR": str(Path(run_dir).absolute()),
             "NANOPT_EXIT_STATUS": details.exit_status, "NANOPT_STEP": details.step,
             "NANOPT_TOTAL_STEPS": details.total_steps, "NANOPT_EXIT_MESSAGE": details.message}
    for name in known:
        env.pop(name, None)  # one left from an outer nanopt (a hook that trains another run) would be wrong here
    env.update({name: str(value) for name, value in known.items() if value is not None})
    return env


def run_exit_hook(command: str, reason: str, run_dir: Path, timeout_s: float, details: ExitDetails) -> HookResult:
    """Run `command` through the shell once, bounded by `timeout_s`, its output appended to the run's on_exit.log
    between a header (time, reason, command) and a footer (what became of it). Never raises: every outcome is in
    the HookResult."""
    header = (f"{_utc_now()} nanopt train ended: {reason} (exit status {details.exit_status}); on_exit: "
              f"{command}\n")
    return _run_logged(command, reason, hook_environment(reason, run_dir, details), RunDir(run_dir).exit_hook_log,
                       header, timeout_s, "on_exit")


def run_event_hook(command: str, event: dict[str, Any], run_dir: Path, timeout_s: float) -> HookResult:
    """The --on-event command, once per health verdict (nanopt.train.health.verdicts), run as the on-exit command is
    (the shell, a session of its own, bounded by `timeout_s`, its output capped) into the run's on_event.log, with
    NANOPT_EVENT (the verdict's name), NANOPT_EVENT_STEP, NANOPT_EVENT_MESSAGE (what was seen; what usually fixes
    it) and NANOPT_RUN_DIR. Never raises."""
    env = hook_environment("", run_dir, ExitDetails(exit_status=0))
    for name in ("NANOPT_EXIT_REASON", "NANOPT_EXIT_STATUS"):  # the run has not ended
        env.pop(name, None)
    env.update({"NANOPT_EVENT": str(event["verdict"]), "NANOPT_EVENT_STEP": str(event["step"]),
                "NANOPT_EVENT_MESSAGE": f"{event['message']}; {event['advice']}"})
    header = f"{_utc_now()} nanopt train event: {event['verdict']} at step {event['step']}; on_event: {command}\n"
    return _run_logged(command, str(event["verdict"]), env, RunDir(run_dir).event_hook_log, header, timeout_s,
                       "on_event")


def _run_logged(command: str, reason: str, env: dict[str, str], log_path: Path, header: str, timeout_s: float,
                name: str) -> HookResult:
    log, log_error = _open_log(log_path, header)
    started = time.monotonic()
    with log if log is not None else open(os.devnull, "wb") as output, _terminate_deferred():
        outcome = _run_command(command, env, output, timeout_s)
        result = HookResult(command, reason, time.monotonic() - started, timeout_s, **outcome,
                            log=log_path if log is not None else None, log_error=log_error)
        if log is not None and (footer_error := _write(log, f"{_utc_now()} {name} {result.outcome()}\n")):
            result = replace(result, log_error=footer_error)
    return result


def _run_command(command: str, env: dict[str, str], output: IO[bytes], timeout_s: float) -> dict:
    """The shell's exit code, or how it ended otherwise. Its own session: a timeout or Ctrl-C kills its whole process
    group (what it started too), and torchrun's or a terminal's signals to nanopt's group do not cut it short. Its
    output reaches the log through the capper (_CAPPER), at most LOG_CAP_BYTES of it."""
    read_end, write_end = os.pipe()
    try:
        capper = subprocess.Popen(["/bin/sh", "-c", _CAPPER, "capper", str(LOG_CAP_BYTES)], stdin=read_end,
                                  stdout=output, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc = subprocess.Popen(command, shell=True, stdin=subprocess.DEVNULL, stdout=write_end,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        finally:
            os.close(write_end)  # the command's copy is the only writer: its end is the capper's end of input
    except OSError as exc:  # no /bin/sh, no processes left, ...
        return {"start_error": exc.strerror or str(exc)}
    finally:
        os.close(read_end)
    try:
        return {"exit_code": proc.wait(timeout=timeout_s)}
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"timed_out": True}
    except KeyboardInterrupt:  # Ctrl-C while it runs: the person wants it stopped, not nanopt's exit status changed
        _kill_group(proc)
        return {"stopped": True}
    finally:
        # Its last output is in the log before the footer, unless a background job it left still holds the pipe.
        with contextlib.suppress(subprocess.TimeoutExpired):
            capper.wait(timeout=KILL_GRACE_S)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group, then SIGKILL to whatever of it is left after a short grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the shell or ignore SIGTERM
    proc.wait()


@contextlib.contextmanager
def _terminate_deferred() -> Iterator[None]:
    """SIGTERM is held off while the command runs (which is bounded by its timeout): nanopt ends right after it
    anyway, and a second preemption notice, or torchrun stopping rank 0 because another rank already left with the
    same error, must neither cut the command short nor change the run's exit status. A handler, not SIG_IGN: an
    ignored signal would stay ignored in the command itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _open_log(path: Path, header: str) -> tuple[IO[bytes] | None, str | None]:
    """The log opened for appending with the header written, or why it cannot be. Never creates the run directory:
    a mistyped one must not appear because of the hook."""
    try:
        log = open_file(path, "ab")  # never through a link
    except WritePathError as exc:
        return None, exc.message
    except OSError as exc:
        return None, f"could not write {path}: {exc.strerror or exc}"
    error = _write(log, header)
    if error:
        log.close()
        return None, error
    return log, None


def _write(log: IO[bytes], text: str) -> str | None:
    try:
        log.write(text.encode("utf-8", "replace"))
        log.flush()  # before the command appends its own output after it
    except OSError as exc:
        return f"could not write {log.name}: {exc.strerror or exc}"
    return None


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
