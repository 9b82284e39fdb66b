"""Where a run's wall-clock time goes, and what it costs: one home for time per phase, projections and money.

A session (one `nanopt train` process) is timed from the moment its process started, so imports, building the
model, resuming and torch.compile's first step all count, as they do on the bill. Its time is charged to phases:

    setup       process start to the first step, and the first step itself when the model is compiled
    train       optimizer steps
    eval        in-loop evaluation
    checkpoint  saving checkpoints
    other       the rest: log lines, metrics records, the loss chart, waiting

metrics.jsonl gets a `{"kind": "phases"}` record after every evaluation and checkpoint and when the session ends,
each holding the session's totals so far, so the newest record of each session (keyed by `session_start`) is what
it cost. Phase records are never dropped when a resume truncates metrics.jsonl: the time was spent (and paid for)
whether or not its steps are run again. A session killed without warning (SIGKILL, a lost machine) is counted to
its last record.

Money is time x devices (ranks) x price per device-hour.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PHASES = ("setup", "train", "eval", "checkpoint")  # what the clock charges; "other" is the wall time left over
OTHER = "other"
ALL_PHASES = (*PHASES, OTHER)

# Evaluation past this share of the time is worth a warning: write-ups of real runs put it at 11-16% of the cost.
EVAL_SHARE_WARNING = 0.10


def process_start_time() -> float:
    """When this process started (Unix seconds): the session is billed from here, imports included."""
    import psutil

    try:
        return psutil.Process().create_time()
    except (psutil.Error, OSError):
        return time.time()


class PhaseClock:
    """Seconds per phase of one session. Time outside `phase()` blocks, after setup ends, is `other`."""

    def __init__(self, started: float | None = None) -> None:
        self.started = process_start_time() if started is None else started
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.last: dict[str, float | None] = dict.fromkeys(PHASES)  # the latest one: steady state, past warm-up
        self.setup_done = False

    def wall(self) -> float:
        return max(0.0, time.time() - self.started)

    def end_setup(self) -> None:
        """Setup is everything from the process start to now (called once, when the first step may begin)."""
        if not self.setup_done:
            self.seconds["setup"] = self.wall()
            self.setup_done = True

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.last[name] = time.perf_counter() - begun
            self.seconds[name] += self.last[name]

    def recharge(self, seconds: float, source: str, to: str) -> None:
        """Charge to `to` seconds the clock counted in `source` (no more than it holds) that were `to`'s work:
        on a CPU, a background checkpoint write's CPU time, which the steps running beside it lost."""
        moved = min(seconds, self.seconds[source])
        self.seconds[source] -= moved
        self.seconds[to] += moved

    def totals(self, wall: float) -> dict[str, float]:
        """Seconds per phase including `other`, adding up to `wall`, the session's wall time so far."""
        named = dict(self.seconds)
        return {**named, OTHER: max(0.0, wall - sum(named.values()))}

    def record(self) -> dict[str, Any]:
        """The fields of a metrics.jsonl `phases` record (the caller adds step, world size and price)."""
        wall = self.wall()
        return {"session_start": self.started, "wall_s": wall, "seconds": self.totals(wall)}


@dataclass
class RunTime:
    """Time and money of a run over its sessions, from the phases records of metrics.jsonl."""

    sessions: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ALL_PHASES, 0.0))
    device_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ALL_PHASES, 0.0))
    cost: dict[str, float] | None = field(default_factory=lambda: dict.fromkeys(ALL_PHASES, 0.0))

    @property
    def wall_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def device_hours(self) -> float:
        return sum(self.device_seconds.values()) / 3600

    @property
    def cost_usd(self) -> float | None:
        return None if self.cost is None else sum(self.cost.values())

    def add(self, record: dict[str, Any], price_per_hour: float | None = None) -> None:
        """One session's newest phases record; `price_per_hour` (else the record's own price) prices it."""
        world = int(record.get("world_size") or 1)
        price = price_per_hour if price_per_hour is not None else record.get("price_per_hour")
        self.sessions += 1
        for name in ALL_PHASES:
            seconds = float((record.get("seconds") or {}).get(name) or 0.0)
            self.seconds[name] += seconds
            self.device_seconds[name] += seconds * world
            if self.cost is not None:
                self.cost[name] += seconds * world / 3600 * price if price is not None else math.nan
        if self.cost is not None and any(math.isnan(v) for v in self.cost.values()):
            self.cost = None  # one unpriced session leaves the run's cost unknown, not understated

    def to_dict(self) -> dict[str, Any]:
        wall = self.wall_seconds
        cost = self.cost
        return {
            "sessions": self.sessions, "wall_seconds": wall, "device_hours": self.device_hours,
            "cost_usd": self.cost_usd,
            "cost_excluding_eval_usd": None if cost is None else sum(v for k, v in cost.items() if k != "eval"),
            "phases": {name: {"seconds": self.seconds[name], "share": self.seconds[name] / wall if wall else 0.0,
                              "cost_usd": None if cost is None else cost[name]} for name in ALL_PHASES},
        }


def newest_per_session(records: Iterable[dict[str, Any]], up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The newest `phases` record of each session (up to a step, when given): what each session cost."""
    newest: dict[float, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") != "phases" or not isinstance(record.get("session_start"), (int, float)):
            continue
        if up_to_step is not None and int(record.get("step") or 0) > up_to_step:
            continue
        newest[record["session_start"]] = record  # records are in time order: the last one wins
    return list(newest.values())


def run_time(records: Iterable[dict[str, Any]], up_to_step: int | None = None,
             price_per_hour: float | None = None) -> RunTime | None:
    """The run's time per phase from metrics.jsonl records, priced at `price_per_hour` (else each session's own
    price). None when there is no phases record (a run trained before nanopt recorded phases)."""
    sessions = newest_per_session(records, up_to_step)
    if not sessions:
        return None
    total = RunTime()
    for record in sessions:
        total.add(record, price_per_hour)
    return total


def occasions(interval: int, after_step: int, total_steps: int) -> int:
    """How many evaluations (or checkpoints) a run with this interval makes after `after_step`: one at every
    multiple of the interval, and one at the last step (0 interval: only at the last step, or none for eval)."""
    if after_step >= total_steps:
        return 0
    if interval <= 0:
        return 1
    multiples = total_steps // interval - after_step // interval
    return multiples + (0 if total_steps % interval == 0 else 1)


def projected_seconds(run: Any, from_step: int, step_s: float, eval_s: float | None,
                      checkpoint_s: float | None, setup_s: float = 0.0) -> dict[str, float]:
    """Seconds per phase to take `run` (a RunConfig) from `from_step` to its end at these measured durations:
    the steps left, the evaluations and checkpoints they include, and a setup. Other time is not projected.
    `step_s` is a full-size step's: the steps left count as their tokens in full batches (batch warmup's are less)."""
    train = run.train
    evals = occasions(train.eval_interval, from_step, run.total_steps) if train.eval_interval else 0
    checkpoints = occasions(train.checkpoint_interval, from_step, run.total_steps)
    full_steps_left = max(0, run.total_tokens - train.tokens_before(from_step)) / train.global_batch_tokens
    return {"setup": setup_s, "train": full_steps_left * step_s,
            "eval": evals * (eval_s or 0.0), "checkpoint": checkpoints * (checkpoint_s or 0.0)}


class EvalShareWatch:
    """Judges evaluation's cost interval by interval: the latest evaluation against the steps since the one before,
    both timed in the same stretch of the run, so a slow first step (torch.compile) or a busy machine weighs on both
    sides alike. Costly means over EVAL_SHARE_WARNING in two intervals running: one slow evaluation is noise."""

    def __init__(self) -> None:
        self.mark: tuple[int, float] | None = None  # (step, the session's train seconds) at the last evaluation
        self.over_before = False
        self.warned = False

    def costly(self, step: int, train_seconds: float, eval_s: float) -> tuple[float, float] | None:
        """After an evaluation at `step`: (share, seconds per step) when it calls for a warning (once), else None."""
        mark, self.mark = self.mark, (step, train_seconds)
        if mark is None or step <= mark[0] or self.warned:
            return None
        step_s = (train_seconds - mark[1]) / (step - mark[0])
        share = eval_s / max(eval_s + (train_seconds - mark[1]), 1e-9)
        over = share > EVAL_SHARE_WARNING
        twice, self.over_before = over and self.over_before, over
        if not twice:
            return None
        self.warned = True
        return share, step_s


def eval_advice(eval_s: float, step_s: float, run: Any) -> dict[str, Any]:
    """The eval_interval and eval_tokens that would each bring evaluation under EVAL_SHARE_WARNING of the time
    spent in steps and evaluation, given one evaluation's and one step's seconds (evaluation time is taken to
    grow with its tokens)."""
    ratio = (1 - EVAL_SHARE_WARNING) / EVAL_SHARE_WARNING  # e / (e + I t) <= share  <=>  I >= ratio e / t
    interval = math.ceil(ratio * eval_s / max(step_s, 1e-9))
    tokens = int(run.train.eval_tokens * run.train.eval_interval * step_s / (ratio * max(eval_s, 1e-9)))
    unit = run.seq_len * run.train.micro_batch_size
    return {"eval_interval": interval, "eval_tokens": max(unit, tokens // unit * unit)}
