"""How nanopt writes and deletes files: never through a link (docs/design.md, "The trust boundary").

A run directory, a dataset or an export may come from someone else, and a link planted where nanopt writes would
make it overwrite, append to or delete whatever the link names. So every write goes through here:

- open_file: O_NOFOLLOW (a link at the path is refused, never followed) and O_NONBLOCK (a FIFO never blocks),
  then fstat: a regular file with no other name (a hard link); truncated only after that check;
- replacing / replace_file: the new contents go to a temporary created exclusively beside the file
  (nanopt.rundir.temporary), fsync'd and renamed over it, so a reader never sees half a file;
- create_file: a new file whose name appears with its whole contents (written as .tmp-NAME, then renamed), its
  descriptor kept open by the caller;
- make_dir / new_dir: a directory nanopt writes into is a real directory, never a link or a file;
- remove_tree: deletes a real directory inside a given root only, never through a link;
- check_run_dir: the one check of a run directory before a command's first write into it.

New files get 0644 and directories 0755, less the umask: group and world never get write (train.json holds
`on_exit`, a shell command), and a replaced file never keeps the mode of the one it replaces.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from nanopt.errors import WritePathError
from nanopt.rundir import RunDir, is_checkpoint_entry, staged, temporary

FILE_MODE = 0o644  # less the umask: the kernel applies it at creation
DIR_MODE = 0o755
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_MODES = {"w": os.O_WRONLY, "a": os.O_WRONLY | os.O_APPEND, "a+": os.O_RDWR | os.O_APPEND}
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


# ------------------------------------------------------------------------------------------------- refusals


LINK_HINT = "remove the link; to keep a run's files on another disk, move the whole run directory there"


def link_refused(path: Path, hint: str = LINK_HINT) -> WritePathError:
    return WritePathError(f"{path}: is a symbolic link, and nanopt never writes or deletes through one", hint)


def file_kind(mode: int) -> str:
    """What a file of this st_mode is, for a message: "a named pipe (FIFO)", "a directory", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_file(path: Path, st: os.stat_result) -> None:
    """WritePathError unless `st` (of `path`) is a regular file that has no other name."""
    if stat.S_ISLNK(st.st_mode):
        raise link_refused(path)
    if not stat.S_ISREG(st.st_mode):
        raise WritePathError(f"{path}: is {file_kind(st.st_mode)}, where nanopt writes a file", "move it away")
    if st.st_nlink > 1:  # writing in place would change the file under its other names too
        raise WritePathError(f"{path}: has other names (hard links), which writing it would change too",
                             "replace it with a copy of itself (cp, not ln), or remove it")


def check_dir(path: Path) -> None:
    """WritePathError unless `path` is a directory (OSError if there is nothing)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise link_refused(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a file" if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)
        raise WritePathError(f"{path}: is {kind}, where nanopt keeps a directory",
                             f"move or rename it: nanopt writes its {path.name}/ there")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


# -------------------------------------------------------------------------------------------------- files


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | _NO_FOLLOW, FILE_MODE)
    except OSError as exc:
        st = _lstat(path)
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR) and st is not None:
            _check_file(path, st)  # a link, a FIFO no process reads (which would block), a directory
        raise


def open_file(path: Path, mode: str = "wb", encoding: str | None = None) -> IO[Any]:
    """`path` opened to write ("w": truncated, "a": appended to, "a+": read and appended to; with "b": bytes),
    created with FILE_MODE if missing. WritePathError for a link, anything but a regular file, or a file with
    other names; OSError as open() raises it otherwise."""
    fd = _open(Path(path), _MODES[mode.replace("b", "")] | os.O_CREAT)
    try:
        _check_file(Path(path), os.fstat(fd))
        if mode.startswith("w"):
            os.ftruncate(fd, 0)  # only now: truncating before the check could empty another file
        return os.fdopen(fd, mode, encoding=encoding)
    except BaseException:
        os.close(fd)
        raise


def append_whole(path: Path, text: str) -> None:
    """`text` appended to `path` whole or not at all (created if missing, never through a link): a full disk or a
    file-size limit may take part of a write, and a torn line would stay in an append-only record such as
    metrics.jsonl, so on any failure the file is cut back to its length before. A file that already ends in a torn
    line (a writer killed inside its write, a machine that lost power) gets a newline first: appended to that line,
    the new one would be torn too, and its readers would skip both."""
    data = text.encode("utf-8")
    fd = _open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        st = os.fstat(fd)
        _check_file(Path(path), st)
        if st.st_size and not _ends_a_line(path, st.st_size):
            data = b"\n" + data
        try:
            done = 0
            while done < len(data):  # a short write is retried: the rest either fits or raises (EFBIG, ENOSPC)
                done += os.write(fd, data[done:])
        except OSError as exc:
            os.ftruncate(fd, st.st_size)
            raise OSError(exc.errno, exc.strerror, str(path)) from None  # os.write's error names no file
    finally:
        os.close(fd)


def _ends_a_line(path: Path, size: int) -> bool:
    """Whether the file's last byte is a newline (read through a descriptor of its own: the appending one is
    write-only). A file that cannot be read is taken to end one: nothing is added to it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return True
    try:
        return os.pread(fd, 1, size - 1) in (b"\n", b"")
    finally:
        os.close(fd)


def create_file(path: Path, data: bytes | str) -> int:
    """A new file at `path` holding `data`, and its descriptor, left open for the caller to keep (a checkpoint hold
    refreshes its time through it) and close. FileExistsError if anything is at `path`, a link included.

    The name appears with the whole contents: they are written to rundir.staged(path), created exclusively, which
    is then renamed to `path`. Created at `path` and written after, a writer killed between the two (SIGKILL, the
    OOM killer) would leave the name empty for good, and a reader could not tell it from one still being written.
    Killed before the rename, it leaves only the .tmp- name, which its reader must count as nothing (see
    nanopt.train.checkpoint.hold). A link planted at `path` after the look and before the rename is replaced,
    never followed."""
    path = Path(path)
    tmp = staged(path)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        data = data.encode("utf-8") if isinstance(data, str) else data
        done = 0
        while done < len(data):  # a short write is retried
            done += os.write(fd, data[done:])
        if _lstat(path) is not None:
            raise FileExistsError(errno.EEXIST, "file exists", str(path))
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return fd


def write_file(path: Path, data: bytes | str) -> None:
    """`path` written whole, in place: a file in a directory nanopt made for it (replace_file otherwise)."""
    with open_file(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A new file for `path`'s next contents, fsync'd and renamed over `path` when the block completes, removed
    when it does not. It is rundir.temporary(path), created exclusively (a killed writer's leftover is removed
    first); a link at either name, or a directory at `path`, is refused."""
    path = Path(path)
    st = _lstat(path)
    if st is not None and (stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        _check_file(path, st)
    tmp = temporary(path)
    st = _lstat(tmp)
    if st is not None:
        _check_file(tmp, st)
        os.unlink(tmp)
    fd = _open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_file(path: Path, data: bytes | str) -> None:
    """`path` replaced whole by `data` (see replacing)."""
    with replacing(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def copy_file(source: Path, target: Path) -> None:
    """`source`'s bytes into `target`, opened as open_file opens it."""
    with open(source, "rb") as src, open_file(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)


def give_file_mode(*paths: Path) -> None:
    """Give files another library wrote into a directory nanopt made (safetensors: 0600; torch's DCP: 0666 less
    the umask) the mode nanopt's own new files get there: FILE_MODE less the umask, or what a default ACL allows.
    Learnt from a probe file: reading the umask means setting it, which races with threads creating files."""
    probe = paths[0].parent / f".mode-probe-{os.getpid()}-{threading.get_ident()}"
    fd = _open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        os.unlink(probe)
    for path in paths:
        fd = _open(path, os.O_RDONLY)
        try:
            _check_file(path, os.fstat(fd))
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------------------ directories


def make_dir(path: Path, *, parents: bool = False) -> Path:
    """`path` as a directory nanopt may write into: made (DIR_MODE less the umask) if missing, with its missing
    parents when asked; WritePathError if a link or anything but a directory is there."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        check_dir(path)
    return path


def new_dir(path: Path) -> Path:
    """A new, empty directory of nanopt's own (DIR_MODE less the umask): FileExistsError if anything is there."""
    os.mkdir(path, DIR_MODE)
    return Path(path)


def remove_tree(path: Path, inside: Path, *, quiet: bool = False) -> None:
    """Delete the directory `path`, which must lie inside `inside` (compared resolved, `inside` itself not a link):
    a link at `path` is refused and shutil.rmtree never follows one below it, so nothing outside is deleted.
    A missing `path` is fine. `quiet` (clean-up on the way out of an error) leaves a refused path alone and ignores
    OSError."""
    path, inside = Path(path), Path(inside)
    try:
        check_dir(inside)
        root, parent = inside.resolve(), path.parent.resolve()
        if parent != root and root not in parent.parents:
            raise WritePathError(f"{path}: is outside {inside}, and nanopt deletes only inside it",
                                 "this is a bug in nanopt, or the directory changed while it ran")
        if _lstat(path) is not None:
            check_dir(path)
            shutil.rmtree(path)  # fd-based on Linux: never descends through a link (rmtree.avoids_symlink_attacks)
    except (WritePathError, OSError):
        if not quiet:
            raise


# -------------------------------------------------------------------------------------------- the run check


def check_run_dir(run_dir: Path) -> None:
    """The one check of a run directory before a command's first write (train, eval, find-batch, profile,
    preflight), before any lock is taken, step run or loss measured: WritePathError, in one line naming the path,
    for a link at any path nanopt writes or deletes there (RunDir.written_dirs and written_files, and the step-N/
    and .tmp-* directories in checkpoints/), for anything but a regular file where it writes a file, and for
    anything but a directory at checkpoints/ and previous/ (a `checkpoints` file used to train until the first
    save and then fail with a disk-space hint)."""
    paths = RunDir(run_dir)
    for path in paths.written_dirs():
        st = _lstat(path)
        # TensorBoard, W&B and the profiler are handed their directory, and only a link there is refused: a
        # sink that cannot write is a warning (nanopt.train.observe.sinks), never the end of a paid-for run.
        if st is not None and (path in (paths.checkpoints, paths.previous) or stat.S_ISLNK(st.st_mode)):
            check_dir(path)
    for path in paths.written_files():
        st = _lstat(path)
        # The on-exit hook's log is best effort (a run never depends on its hook): there only a link is refused.
        if st is not None and (path != paths.exit_hook_log or stat.S_ISLNK(st.st_mode)):
            _check_file(path, st)
    if _lstat(paths.checkpoints) is not None:
        for entry in os.scandir(paths.checkpoints):
            if is_checkpoint_entry(entry.name) and entry.is_symlink():
                raise link_refused(Path(entry.path))
