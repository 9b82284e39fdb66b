"""Errors met by torchrun workers, handed to nanopt's launcher so each is printed once, with the rank that met it.

Every rank of a job may fail: all alike (a bad setting every rank reads), one alone (a bad token id only rank 1's
batch holds), or as a consequence (the ranks that lose contact when another dies). The launcher sets
NANOPT_ERROR_DIR for its workers; a failing worker writes its one line there instead of printing it, and the
launcher prints the causes: one line when every rank says the same, else one per rank, and the report of lost
contact only when nothing else explains the failure. A rank that crashed (an exception that is not a nanopt error: a
bug) leaves its line too, marked, so the launcher exits 1 naming it, and rank 0's on-exit command hears `crashed`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from nanopt.errors import NanoptError
from nanopt.files import replace_file

ERROR_DIR_ENV = "NANOPT_ERROR_DIR"


@dataclass(frozen=True)
class RankError:
    rank: int
    line: str
    lost_contact: bool
    crashed: bool = False


def hand_to_launcher(rank: int, line: str, lost_contact: bool, crashed: bool = False) -> bool:
    """Leave this rank's error line for the launcher; False when no nanopt launcher is listening."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    record = {"rank": rank, "line": line, "lost_contact": lost_contact, "crashed": crashed}
    try:
        replace_file(Path(folder, f"rank{rank}.json"), json.dumps(record))  # never through a link
    except (OSError, NanoptError):
        return False
    return True


def collected(folder: Path) -> list[RankError]:
    found = []
    for path in sorted(folder.glob("rank*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            found.append(RankError(int(record["rank"]), str(record["line"]), bool(record["lost_contact"]),
                                   bool(record.get("crashed", False))))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda e: e.rank)


def crash_of_another_rank(rank: int) -> RankError | None:
    """The crash another rank of this node handed to the launcher, if any: a rank that lost contact asks, so that
    what it reports (rank 0's on-exit reason) is the crash, not its consequence. A crashed rank writes its line
    before its sockets close, so it is there by the time the others notice."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return None
    return next((e for e in collected(Path(folder)) if e.crashed and e.rank != rank), None)


def lines_to_print(errors: list[RankError]) -> list[str]:
    """The causes, each once: one line if every rank that failed says the same, else one line per rank (a rank that
    crashed alone is always named, rank 0 too)."""
    causes = [e for e in errors if not e.lost_contact] or errors[:1]
    if not causes:
        return []
    if len({e.line for e in causes}) == 1 and (len(causes) > 1 or (causes[0].rank == 0 and not causes[0].crashed)):
        return [causes[0].line]
    return [f"rank {e.rank}: {e.line}" for e in causes]
