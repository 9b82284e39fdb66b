"""How a training session's failures reach the person: a lost peer, a full or read-only disk and an
out-of-memory error each become one line that says what was kept and how to go on, on every rank alike."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import DistributedError, NanoptError
from nanopt.rundir import RunDir
from nanopt.runtime import quiesce
from nanopt.train import checkpoint as ckpt
from nanopt.train.guard.oom import is_out_of_memory, out_of_memory_error
from nanopt.train.session import Session

# A disk that refuses writes: full, over quota, past a file-size limit, read-only, or not ours to write.
DISK_ERRORS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def reporting_failures(run: RunConfig, rt: Any, work: Callable[[], Any], s: Session | None = None) -> Any:
    """`work()`, with a lost peer and a full or read-only disk turned into one-line errors that say what is kept."""
    try:
        return work()
    except NanoptError:  # decided on every rank together (diverged, disk full), so all can still meet
        quiesce(rt)
        raise
    except RuntimeError as exc:
        if is_out_of_memory(exc):  # torch.OutOfMemoryError is a RuntimeError
            raise out_of_memory_error(exc, rt.device, s.state.step + 1 if s else None, _latest(run)) from None
        if rt.distributed and _lost_peer(exc):
            raise _peer_error(run, rt, s, exc) from None
        raise
    except OSError as exc:  # metrics.jsonl and loss.png meet a full disk first: they are written most often
        if exc.errno not in DISK_ERRORS:
            raise
        raise _disk_error(run, s, exc) from None


def _lost_peer(exc: RuntimeError) -> bool:
    """A collective that failed because another rank died, hung past the timeout or dropped off the network."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or "gloo" in str(exc) or "NCCL" in str(exc)


def _latest(run: RunConfig) -> str:
    return ckpt.read_pointer(RunDir(run.run_dir).checkpoints, "latest") or "none yet"


def _peer_error(run: RunConfig, rt: Any, s: Session | None, exc: RuntimeError) -> DistributedError:
    detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    where = f" at step {s.state.step}" if s is not None else " while setting up"
    return DistributedError(f"rank {rt.rank} lost contact with another rank{where} ({detail})",
                            f"another rank died or hung (its own error says why; the wait is capped by "
                            f"NANOPT_PG_TIMEOUT_S); complete checkpoints are kept (latest: {_latest(run)}): run the "
                            "same command to resume")


def _disk_error(run: RunConfig, s: Session | None, exc: OSError) -> NanoptError:
    where = f" at step {s.state.step}" if s is not None else " while setting up"
    return NanoptError(f"could not write {exc.filename or 'into ' + str(run.run_dir)}{where}: {exc.strerror}",
                       f"free disk space or make {run.run_dir} writable; complete checkpoints are kept (latest: "
                       f"{_latest(run)}): run the same command to resume")
