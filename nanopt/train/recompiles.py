"""Recompilations of the compiled model during training steps, said as they happen: a line and a `recompile` event.

torch.compile compiles the model's graph in a session's first step, and again at each new input shape: the first
step of a sequence-length stage is expected to (its graphs are static, nanopt.train.parallel.wrap), and is said as
expected. Any other compilation inside a training step is a surprise: a guard Dynamo placed on the inputs or on
global state failed (a dtype, a shape, a flag), it costs seconds to minutes each time, and past Dynamo's
recompile_limit the model runs uncompiled. Evaluation compiles graphs of its own (no gradients, other shapes)
between the steps, where nothing is watched.

Read from Dynamo's record of each compilation (torch._dynamo.utils.get_compilation_metrics: the compile id, the
guard failure that caused it, its duration), which torch keeps whatever its logging settings: torch.compiler has
no public hook for recompilations through torch 2.13, and TORCH_LOGS=recompiles prints to stderr in torch's own
words. Comparing the newest record before and after a step copies a list of a few dozen items on the host, with
no device sync. Where the record is missing (another torch), nothing is said.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nanopt.train.session import Session

REASON_CHARS = 500  # of Dynamo's guard failure in the event (the line shows its first line)


def _records() -> list[Any]:
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        return []
    return get_compilation_metrics()


def _since(before: Any) -> list[Any]:
    """The compilation records newer than `before` (the newest one earlier; None: there was none)."""
    records = _records()
    for index in range(len(records) - 1, -1, -1):
        if records[index] is before:
            return records[index + 1:]
    return records  # `before` aged out of torch's bounded record: all of it is newer


class CompileWatch:
    """Around each training step of a compiled model, the compilations it made; the session's first step's are
    its own compile, said at start-up, and pass unremarked."""

    def __init__(self, s: Session) -> None:
        self.on = bool(s.prepared.compiled)
        self.first = True

    @contextmanager
    def step(self, s: Session, new_shape: bool) -> Iterator[None]:
        """Watch one step; `new_shape`: it starts a sequence-length stage, whose new shape compiles by design."""
        if not self.on:
            yield
            return
        newest = _records()
        before = newest[-1] if newest else None
        yield
        first, self.first = self.first, False
        made = [] if first else _since(before)
        if any(_is_frame(r) for r in made):
            _announce(s, made, expected=new_shape)


def _is_frame(record: Any) -> bool:
    """A graph Dynamo traced from Python (the backward graphs compiled for it have no code object)."""
    return getattr(record, "co_name", None) is not None


def _announce(s: Session, made: list[Any], expected: bool) -> None:
    """A `recompile` event and one line for the step just taken, which made the compilations `made`."""
    graphs = [r for r in made if _is_frame(r)]
    reasons = [str(r.recompile_reason) for r in graphs if getattr(r, "recompile_reason", None)]
    reason = reasons[0][:REASON_CHARS] if reasons else None
    seconds = sum((getattr(r, "duration_us", None) or 0) for r in made) / 1e6
    step = s.state.step
    s.metrics.write("event", step=step, event="recompile", expected=expected, reason=reason,
                    compile_id=str(getattr(graphs[0], "compile_id", "")), function=graphs[0].co_name,
                    graphs=len(graphs), compile_s=seconds)
    why = f"; Dynamo: \"{reason.splitlines()[0]}\"" if reason else ""
    if expected:
        s.observer.note(f"step {step}: torch.compile compiled the new sequence length's graph, as expected "
                        f"({seconds:.1f} s{why})")
        return
    count = f"{len(graphs)} graph{'s' if len(graphs) > 1 else ''}"
    s.observer.note(f"warning: step {step}: the compiled training step recompiled ({count}, {seconds:.1f} s{why}); "
                    "every recompilation costs as much again, and past Dynamo's recompile_limit the model runs "
                    "uncompiled (TORCH_LOGS=recompiles lists each guard that failed)")
