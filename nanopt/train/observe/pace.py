"""A training session's pace on its machine: the CPU threads it runs with, said at the start, and a slowdown, said
once, when the steps fall to under half the pace they kept earlier in the same session. Other work has then taken
the machine's cores (or the GPU), and nothing else would say so: on a shared CPU torch's threads wait for busy cores
at every operator (one process ran 3-8x slower with two threads than with one, and its ETA swung from 20 minutes
to almost two hours without a word).

The pace is measured over spans of log windows (at least SPAN_S seconds each, so a window of one short step, or a
garbage collection inside one, is no measurement): the reference is the best median of REFERENCE_SPANS spans in a
row so far (the first span, with its warm-up or compiling step, only lowers a median), and a slowdown is
SUSTAINED_SPANS spans in a row, each under SLOW_SHARE of it. A window during which a checkpoint was being written in
the background (this process's own work, not the machine's) counts neither way; a new seq_len (its stage) starts a
new reference, as its tokens cost another amount of work. Rank 0 only: nothing here is a collective.

The person hears of a slowdown once per session through the observer's note, and metrics.jsonl records a
`slowdown` event (step, tokens_per_s, reference_tokens_per_s, reference_steps, device, threads, threads_chosen).
The training loop calls `announce` after its start-up line and `after_log` at each log step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from nanopt.untrusted_text import shell_word

SLOW_SHARE = 0.5  # "far below": half the pace. Step times on an idle machine vary by far less
SPAN_S = 1.0
REFERENCE_SPANS = 3
SUSTAINED_SPANS = 2


@dataclass(frozen=True)
class Slowdown:
    step: int
    tokens_per_s: float  # over the slow spans
    reference_tokens_per_s: float
    reference_steps: tuple[int, int]  # the first and last step of the spans the reference was measured over


@dataclass
class _Span:
    first_step: int
    last_step: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


class SlowdownWatch:
    """The pace of one session's log windows, and whether it has fallen far below its best (module docstring)."""

    def __init__(self) -> None:
        self.said = False
        self._restart(None)

    def _restart(self, seq_len: int | None) -> None:
        self.seq_len = seq_len
        self.span: _Span | None = None
        self.recent: deque[_Span] = deque(maxlen=REFERENCE_SPANS)
        self.reference: tuple[float, int, int] | None = None  # tokens/s, first step, last step
        self.slow: list[_Span] = []

    def observe(self, step: int, tokens: float, seconds: float, seq_len: int | None = None,
                disturbed: bool = False) -> Slowdown | None:
        """A log window: the steps up to `step` trained `tokens` in `seconds` (pauses excluded). `disturbed`: our
        own background work shared the window, which then counts neither way. A Slowdown the first time the pace
        has stayed far below the reference; None otherwise, and always after that."""
        if self.said or not (tokens > 0 and seconds > 0):
            return None
        if seq_len != self.seq_len:
            self._restart(seq_len)
        if disturbed:
            self.span = None
            return None
        span = self.span or _Span(first_step=step)
        span.last_step, span.tokens, span.seconds = step, span.tokens + tokens, span.seconds + seconds
        self.span = span if span.seconds < SPAN_S else None
        if self.span is not None:
            return None
        return self._judge(span)

    def _judge(self, span: _Span) -> Slowdown | None:
        if self.reference is not None and span.rate < SLOW_SHARE * self.reference[0]:
            self.slow.append(span)
            if len(self.slow) < SUSTAINED_SPANS:
                return None
            self.said = True
            rate = sum(s.tokens for s in self.slow) / sum(s.seconds for s in self.slow)
            return Slowdown(step=span.last_step, tokens_per_s=rate, reference_tokens_per_s=self.reference[0],
                            reference_steps=self.reference[1:])
        self.slow = []
        self.recent.append(span)
        if len(self.recent) == REFERENCE_SPANS:
            median = statistics.median(s.rate for s in self.recent)
            if self.reference is None or median > self.reference[0]:
                self.reference = (median, self.recent[0].first_step, self.recent[-1].last_step)
        return None


def announce(s: Any) -> None:
    """On the CPU, the start-up's second line: how many threads torch runs, and why (nanopt.cpu_threads.CPUThreads)."""
    if s.rt.cpu_threads is not None:
        s.observer.note(s.rt.cpu_threads.line())


def after_log(s: Any, record: dict[str, Any], seconds: float) -> None:
    """The training loop's log step (nanopt.train.loop.maybe_log): its window of `seconds` (`record`'s
    tokens_per_s over them) into the session's watch; the first time the pace has fallen far below, a note and a
    `slowdown` event. Rank 0 only."""
    watch = getattr(s, "slowdown", None)
    if watch is None or not s.rt.is_main:
        return
    found = watch.observe(record["step"], record["tokens_per_s"] * seconds, seconds,
                          getattr(s.loader, "seq_len", None), _saving_during(s, time.perf_counter() - seconds))
    if found is None:
        return
    threads = s.rt.cpu_threads
    s.metrics.write("event", step=found.step, event="slowdown", tokens_per_s=found.tokens_per_s,
                    reference_tokens_per_s=found.reference_tokens_per_s, reference_steps=list(found.reference_steps),
                    device=s.rt.device.type, threads=threads.threads if threads else None,
                    threads_chosen=threads.chosen if threads else None)
    s.observer.note(slowdown_note(found, s.rt.device.type, threads, shell_word(s.run.run_dir)))


def slowdown_note(found: Slowdown, device: str, threads: Any, run: str) -> str:
    """One line: how far the pace fell, that the machine seems busy, and what to do about it."""
    first, last = found.reference_steps
    said = (f"step {found.step}: {found.tokens_per_s:,.0f} tokens/s, under {SLOW_SHARE:.0%} of the "
            f"{found.reference_tokens_per_s:,.0f} tokens/s of steps {first}-{last}")
    resume = f"Ctrl-C saves a checkpoint, and `nanopt train {run}` resumes from it"
    if device != "cpu":
        return (f"{said}: the GPU or its host seems busy with other work, or the GPU is throttled (nvidia-smi and "
                "top show which)")
    busy = f"{said}: this machine seems busy with other work (top shows what)"
    if threads is None or threads.threads <= 1:
        return f"{busy}; one thread is the fewest nanopt runs, so the ETA now follows the slower pace"
    if threads.chosen:
        return (f"{busy}; nanopt chose {threads.threads} threads for the cores free at the start, which now wait "
                f"for busy ones: {resume} with threads chosen for the cores free then (or OMP_NUM_THREADS=1)")
    return (f"{busy}; {threads.variable}={threads.threads} threads now wait for busy cores: {resume} with a lower "
            f"{threads.variable}")


def _saving_during(s: Any, since: float) -> bool:
    """Whether a checkpoint was being written in the background (nanopt.train.checkpoint.save) at some time after
    `since` (time.perf_counter()): our own work on the CPU, which slows the steps beside it."""
    pending = getattr(s, "pending_save", None)
    if pending is None:
        return False
    if not pending.future.done():
        return True
    try:
        finished = getattr(pending.future.result(), "finished", None)
    except BaseException:  # its failure is the next wait_for_save's to report
        return False
    return finished is None or finished > since
