"""Holds: retention never deletes a checkpoint that another process is reading (`nanopt eval --watch` scoring it).

    RUN/holds/step-000600.3f9a1c2e0b7d   {"checkpoint": "step-000600", "pid": 4242, "host": "node1", "created": ...}

A reader takes a hold (`Hold`) before it opens a checkpoint and removes it when done; retention, in the trainer,
skips a checkpoint that a live hold names (`is_held`). The trainer only looks (a listing, a stat and a small read per
hold): it never waits for a reader, and a reader never takes the run's lock. A hold is live while its holder
refreshes its time (every HOLD_TTL_S / 4, from a thread) and, on this machine, while its process exists: the hold of
a reader killed here stops counting at once, on another machine after HOLD_TTL_S.

No lock is needed for the race between the two: retention renames a doomed checkpoint out of the step names first
(write.remove_step_dir), looks for holds once more, and renames it back if one appeared; a reader writes its hold
first, then looks for the checkpoint (`still_there`), waiting while a rename is in flight. Either retention sees the
hold, or the reader sees the checkpoint gone.

A hold's file appears whole (nanopt.files.create_file writes it as .tmp-step-N.ID and renames it), so a holder
killed at any moment leaves no hold, or one that names its dead process: never an empty one, which would count for
HOLD_TTL_S. A .tmp- name is never a hold; any reader's remove_stale_holds deletes it (a live holder whose staged file
was deleted writes it again).

Holds are written in RUN/holds/ only, never into checkpoints/. A link at holds/ or at a hold's name is refused
(nanopt.files); retention counts only regular files in a real holds/ directory, with a time no further than
HOLD_TTL_S in the past and none in the future, so a planted file keeps a checkpoint for at most HOLD_TTL_S and never
makes anything be written or deleted outside the run.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import socket
import stat
import threading
import time
from pathlib import Path
from types import TracebackType

from nanopt.errors import NanoptError
from nanopt.files import create_file, make_dir
from nanopt.parsing import read_json
from nanopt.rundir import STEP_NAME, TMP_PREFIX, RunDir

HOLD_TTL_S = 600.0  # a hold not refreshed for this long is stale: its holder is gone (or its machine is)
CLOCK_SLACK_S = 60.0  # machines sharing a file system disagree on the time by this much at most
MAX_HOLD_BYTES = 4096
STAGING_TRIES = 5  # each failed try takes another reader's start (remove_stale_holds) in the instant it stages
RENAME_WAIT_S = 30.0  # how long a reader waits for retention to rename a checkpoint back (microseconds in practice)


def _hold_names(name: str) -> str:
    if not STEP_NAME.fullmatch(name):  # a hold names a step directory, never a path
        raise ValueError(f"not a checkpoint name: {name!r}")
    return f"{name}."


def _holds_dir(run_dir: Path) -> Path | None:
    """RUN/holds when it is a real directory (a link there is never read through); None otherwise."""
    path = RunDir(run_dir).holds
    try:
        return path if stat.S_ISDIR(os.lstat(path).st_mode) else None
    except OSError:
        return None


def hold_is_live(path: Path, now: float | None = None) -> bool:
    """Whether the hold file `path` still counts: a regular file refreshed within HOLD_TTL_S (not in the future) and,
    when it was written on this machine, by a process that still exists."""
    now = time.time() if now is None else now
    try:
        st = os.lstat(path)
    except OSError:
        return False
    age = now - st.st_mtime
    if not stat.S_ISREG(st.st_mode) or not -CLOCK_SLACK_S <= age <= HOLD_TTL_S:
        return False
    try:
        holder = read_json(path, error=NanoptError, max_bytes=MAX_HOLD_BYTES)
    except NanoptError:  # not one nanopt wrote (it writes a hold whole): its time alone decides
        return True
    if isinstance(holder, dict) and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return _process_exists(holder["pid"])
    return True


def _process_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process: it exists
    return True


def is_held(run_dir: Path, name: str) -> bool:
    """Whether a live hold names the checkpoint `name` (step-N) of `run_dir`."""
    holds, prefix = _holds_dir(run_dir), _hold_names(name)
    if holds is None:
        return False
    now = time.time()
    try:
        entries = [holds / entry for entry in os.listdir(holds) if entry.startswith(prefix)]
    except OSError:
        return False
    return any(hold_is_live(path, now) for path in entries)


def still_there(checkpoint: Path, wait_s: float = RENAME_WAIT_S) -> bool:
    """For a reader that has just taken its hold: whether `checkpoint` is (still) a directory. While retention has it
    renamed to .tmp-delete-NAME, either to delete it or to give it back for the hold it just saw, wait for the
    outcome."""
    doomed = checkpoint.with_name(f"{TMP_PREFIX}delete-{checkpoint.name}")
    deadline = time.monotonic() + wait_s
    while not checkpoint.is_dir() and doomed.is_dir() and time.monotonic() < deadline:
        time.sleep(0.01)
    return checkpoint.is_dir() and not checkpoint.is_symlink()


def remove_stale_holds(run_dir: Path) -> int:
    """Delete the regular hold files in RUN/holds that no longer count (their holders are gone), and the staged
    ones (.tmp-step-N.ID: a holder killed before its hold appeared); how many. Only files named after a checkpoint,
    inside a real holds/ directory."""
    holds, removed, now = _holds_dir(run_dir), 0, time.time()
    if holds is None:
        return 0
    for entry in os.scandir(holds):
        staged = entry.name.startswith(TMP_PREFIX)
        name = entry.name.removeprefix(TMP_PREFIX).split(".", 1)[0]
        if STEP_NAME.fullmatch(name) and entry.is_file(follow_symlinks=False) and (
                staged or not hold_is_live(Path(entry.path), now)):
            try:
                os.unlink(entry.path)
                removed += 1
            except OSError:  # another reader removed it first
                pass
    return removed


class Hold:
    """`with Hold(run_dir, "step-000600"):` keeps retention from deleting that checkpoint until the block ends.

    The hold file is created exclusively (never through a link) in RUN/holds/ (made if missing; a link or a file
    there is refused, WritePathError), refreshed from a daemon thread and removed on the way out."""

    def __init__(self, run_dir: Path, name: str) -> None:
        holds = RunDir(run_dir).holds
        self.path = holds / f"{_hold_names(name)}{secrets.token_hex(6)}"
        self.name = name
        self._fd: int | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def __enter__(self) -> Hold:
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        holder = json.dumps({"checkpoint": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                             "created": stamp}) + "\n"
        for attempt in range(STAGING_TRIES):
            make_dir(self.path.parent)
            try:
                self._fd = create_file(self.path, holder)
                break
            except FileNotFoundError:  # a reader starting meanwhile deleted the staged file (or holds/): again
                if attempt == STAGING_TRIES - 1:
                    raise
        self._refresher = threading.Thread(target=self._refresh, name=f"hold {self.name}", daemon=True)
        self._refresher.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(HOLD_TTL_S / 4):
            try:
                os.utime(self._fd)
            except (OSError, TypeError):  # the descriptor is being closed: the hold is ending
                return

    def release(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join()
            self._refresher = None
        if self._fd is not None:
            try:
                os.unlink(self.path)  # removes the name in holds/, whatever it is now, never what a link names
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()
