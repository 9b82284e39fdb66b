"""A stop asked of a training run (SIGTERM from a scheduler or torchrun, Ctrl-C, SLURM's pre-limit USR1) ends it at
a step boundary with a checkpoint, on every rank together, instead of losing the steps since the last one."""

from __future__ import annotations

import signal
from typing import Any

from nanopt.train.session import Session

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class preemption_handler:
    """SIGTERM / SIGINT / SIGUSR1 set a flag; the next step's all-reduce makes every rank stop and save together.
    SIGUSR1 is what `sbatch --signal=USR1@SECONDS` sends before a job's time limit."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        for sig in STOP_SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.session.preempt_requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.session.preempt_requested = True
        self.session.observer.note(f"received {signal.Signals(signum).name}: finishing this step, saving a "
                                   "checkpoint, then exiting (send it again to stop at once)")

    def __exit__(self, kind: Any, *exc: Any) -> None:
        # Leaving with an error: torchrun stops the ranks left with SIGTERM as soon as one has ended, maybe before
        # this one has said why and run the on-exit command. It is leaving anyway (the CLI exits it), so SIGTERM gets
        # a handler that does nothing in place of this one, never after the default, which a SIGTERM between would
        # meet (a handler, not SIG_IGN, which the commands it starts would inherit).
        hold_off_term = kind is not None and self.session.rt.distributed
        for sig, handler in self.previous.items():
            signal.signal(sig, (lambda signum, frame: None) if hold_off_term and sig == signal.SIGTERM else handler)
