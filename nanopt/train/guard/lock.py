"""One writer per run directory: `nanopt train` holds an exclusive lock on RUN/.lock for its whole session.

Two trainings of the same run would overwrite each other's checkpoints and interleave metrics.jsonl. The lock is
fcntl.flock on an open file: the operating system releases it when the process ends, however it ends (SIGKILL, a
crash, a lost node), so a killed run never blocks the next one. The file names its holder (host, pid, time), so a
refusal can say who is training; a finished session removes it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

from nanopt.errors import NanoptError
from nanopt.files import open_file
from nanopt.rundir import RunDir


class RunLocked(NanoptError):
    """Another process is training this run directory."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = RunDir(run_dir).lock
        self.file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunLocked at once (never waits). A run directory that cannot be written at all
        (a read-only mount) is not locked: nobody else can write there either."""
        for _ in range(3):  # the holder may remove the file between our open and our flock: then try again
            try:
                file = open_file(self.path, "a+", encoding="utf-8")  # never through a link: it is truncated below
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    return
                raise
            try:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._refusal(file) from None
            if self._still_the_lock_file(file):
                self.file = file
                self._write_holder()
                return
            file.close()
        raise RunLocked(f"{self.path.parent}: could not take the run's lock {self.path}",
                        "another nanopt process keeps replacing it; make sure only one trains this run")

    def _still_the_lock_file(self, file: IO[str]) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(file.fileno()).st_ino
        except FileNotFoundError:
            return False

    def _refusal(self, file: IO[str]) -> RunLocked:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        return RunLocked(f"{self.path.parent} is being trained by {holder}",
                         "wait for it to finish, or stop it (a stopped or killed run releases the lock); to train "
                         "a copy, use another run directory")

    def _write_holder(self) -> None:
        """Who holds it, for the message another process shows; the lock works without it (a full disk)."""
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        try:
            self.file.seek(0)
            self.file.truncate()
            self.file.write(f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n")
            self.file.flush()
        except OSError:
            pass

    def release(self) -> None:
        """Remove the file while still holding the lock (a waiting opener then sees another inode and retries)."""
        if self.file is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        fcntl.flock(self.file.fileno(), fcntl.LOCK_UN)
        try:
            self.file.close()
        except OSError:  # the holder line a full disk refused is flushed again here: the file is closed all the same
            pass
        self.file = None
