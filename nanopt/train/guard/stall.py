"""The stall watch: a run that makes no progress for train.json's `stall_timeout_s` says so instead of burning
GPU-hours in silence.

A hung run looks like a running one: the process is alive, the GPU shows memory in use, and nothing reaches the log.
Collectives that never complete end at the process group's timeout (NANOPT_PG_TIMEOUT_S), but a GPU that stopped
answering, a read from a stalled network filesystem, or a deadlock do not. Each rank keeps a heartbeat: the loop
beats after every step, and before and after every evaluation and checkpoint. A daemon thread checks it, and once
the heartbeat is older than the timeout it reports once per stall:

- every rank writes the Python stacks of all its threads to RUN/stalls/rank-R.txt. This is where the rank waits,
  and it tells a rank stuck in a collective (a peer is the problem) from the rank that is stuck elsewhere;
- rank 0 also records a `stall` event in metrics.jsonl (step, phase, seconds without progress), prints a warning,
  and runs the --on-event command with NANOPT_EVENT=stall, so a notification or a restart can follow.

When the heartbeat moves again, rank 0 records `stall_over`. The watch only reports; it never stops the run, since
a slow filesystem may recover. It starts after the first step, because that step compiles and may legitimately
take many minutes.

The blocking calls a training step makes (CUDA synchronisation, collectives, file reads) release the GIL, so the
watch's thread runs while the loop waits. A C call that holds the GIL and never returns (a page fault on a stalled
network mmap inside a copy, a native library's deadlock) would freeze the watch too. For that case each of the
watch's polls re-arms Python's faulthandler, whose own C thread needs no GIL: when the watch has not run for the
timeout plus two polls, it prints every thread's stack on stderr (headed "Timeout (H:MM:SS)!"), into the run's
log, once. No event or hook can run then: nothing in Python can.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.errors import NanoptError
from nanopt.files import make_dir, replace_file
from nanopt.rundir import RunDir

POLLS_PER_TIMEOUT = 10  # how often the thread looks at the heartbeat, per timeout (at most every 30 s)


@dataclass(frozen=True)
class Stall:
    step: int
    phase: str
    idle_s: float


class StallWatch:
    """A heartbeat and the thread that watches it. `on_stall(stall)` runs once per stall, `on_over(stall, idle_s)`
    when progress resumes; both in the watch's thread, and an error in either is swallowed (the run must not die of
    its watchdog)."""

    def __init__(self, timeout_s: float, on_stall: Callable[[Stall], None],
                 on_over: Callable[[Stall, float], None]) -> None:
        self.timeout_s = timeout_s
        self.on_stall, self.on_over = on_stall, on_over
        self._beat = (time.monotonic(), 0, "train")  # (when, step, phase): replaced whole, never half-written
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, phase: str = "train") -> None:
        """Progress: called by the loop's thread; one tuple assignment."""
        self._beat = (time.monotonic(), step, phase)

    def start(self) -> None:
        self.beat(*self._beat[1:])
        self._thread = threading.Thread(target=self._watch, name="nanopt-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        poll = min(30.0, self.timeout_s / POLLS_PER_TIMEOUT)
        stalled: tuple[Stall, float] | None = None  # the stall reported, and the heartbeat it saw
        while not self._stop.wait(poll):
            # Pushed back at every poll, so it fires only when this thread cannot run at all (module docstring).
            _arm_frozen_dump(self.timeout_s + 2 * poll)
            when, step, phase = self._beat
            idle = time.monotonic() - when
            if stalled is None and idle > self.timeout_s:
                stalled = (Stall(step, phase, idle), when)
                _quietly(self.on_stall, stalled[0])
            elif stalled is not None and when != stalled[1]:
                _quietly(self.on_over, stalled[0], when - stalled[1])
                stalled = None


def _arm_frozen_dump(after_s: float) -> None:
    """faulthandler's dump of every thread's stack to stderr in `after_s`, unless re-armed or cancelled first."""
    try:
        faulthandler.dump_traceback_later(after_s, repeat=False, file=sys.__stderr__ or sys.stderr)
    except (AttributeError, OSError, RuntimeError, ValueError):  # no usable stderr (a daemon without one): no dump
        pass


def _quietly(callback: Callable[..., None], *args: Any) -> None:
    try:
        callback(*args)
    except Exception:  # noqa: BLE001 - a report that fails must not take the run down with it
        pass


def thread_stacks() -> str:
    """Every thread's Python stack, the watch's own left out, the way a traceback prints it."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ in a training session


def start_stall_watch(session: Any) -> StallWatch | None:
    """The session's watch (a nanopt.train.session.Session), started; None with stall_timeout_s 0."""
    timeout = session.run.train.stall_timeout_s
    if not timeout:
        return None
    watch = StallWatch(timeout, lambda stall: _report(session, stall), lambda stall, s: _over(session, stall, s))
    watch.beat(session.state.step)
    watch.start()
    return watch


def _report(session: Any, stall: Stall) -> None:
    rt, paths = session.rt, RunDir(session.run.run_dir)
    stacks = _write_stacks(paths, rt, stall)
    if not rt.is_main:
        return
    where = "could not be written" if stacks is None else f"is in {stacks}"
    if rt.world_size > 1:
        where += f" (the other ranks': {paths.stalls}/rank-R.txt)"
    session.observer.health({
        "step": stall.step, "verdict": "stall",
        "message": f"no progress for {stall.idle_s:.0f} s in {stall.phase} (stall_timeout_s "
                   f"{session.run.train.stall_timeout_s:g}); every thread's stack {where}",
        "advice": "a rank waiting in a collective (all_reduce, barrier) waits for a peer: read the peer's file; a GPU "
                  "that stopped answering shows in nvidia-smi and the kernel log (Xid). The run is still waiting: "
                  "stop it (Ctrl-C) and run the same command to resume from the last checkpoint"})
    # After the warning: a disk too full for the record must not keep the person from hearing of the stall.
    session.metrics.write("event", step=stall.step, event="stall", phase=stall.phase, idle_s=round(stall.idle_s),
                          stacks=None if stacks is None else str(stacks))


def _write_stacks(paths: RunDir, rt: Any, stall: Stall) -> Path | None:
    """This rank's threads' stacks into RUN/stalls/rank-R.txt; None when they could not be written (a full disk
    must not keep rank 0 from saying that the run stalled)."""
    stacks = paths.stall_stacks(rt.rank)
    try:
        make_dir(paths.stalls)
        replace_file(stacks, f"nanopt train: rank {rt.rank} of {rt.world_size}: no progress for {stall.idle_s:.0f} s "
                             f"at step {stall.step} (phase {stall.phase}), {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
                             f"\n\n{thread_stacks()}")
    except (OSError, NanoptError):
        return None
    return stacks


def _over(session: Any, stall: Stall, idle_s: float) -> None:
    if session.rt.is_main:
        session.metrics.write("event", step=stall.step, event="stall_over", idle_s=round(idle_s))
        session.observer.note(f"progress again after {idle_s:.0f} s without any, at step {stall.step}")
