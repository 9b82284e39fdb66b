"""Run health: the signals that say a run is going wrong, and the verdicts a person can act on.

Pure arithmetic on the numbers of metrics.jsonl (no torch): the training loop feeds each step's loss and gradient
norm and each logged `train` record to a HealthMonitor, which adds the loss's trend to the record and returns the
verdicts it newly reaches; `nanopt eval --health` replays a run's metrics.jsonl through the same monitor. What the
signals are and how they are measured on the device: nanopt.train.health_probe.

Verdicts, each announced once per run (a resumed run reads the `health` events it already wrote):
- initial_loss: the first step's loss is far from ln(token rows), where a model initialised as configured starts
  (the rows of a vocabulary padded past the tokenizer's ids are out of the softmax: ln(vocab_size) would be wrong).
- plateau: the mean loss of the last window (a quarter of the run, 10 to 1000 steps, and 10 log intervals at the
  least) is not below the window before's by more than its noise (one standard error), for half a window.
- stagnating_updates: the update-to-parameter norm ratio of the weight matrices is far below the usual ~1e-3
  (under 1e-5), or has collapsed to a hundredth of its peak per unit of learning rate.
- exploding_gradients: clipping on most steps of the window, or a gradient norm ten times the window before's.
The judgements after step 0 wait for the warmup and one window: a run's first steps are always unruly.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

VERDICTS = ("initial_loss", "plateau", "stagnating_updates", "exploding_gradients")

INITIAL_LOSS_TOLERANCE = 0.2  # far off: more than this fraction of ln(vocab) (and at least a nat) away from it
MIN_WINDOW_STEPS, MAX_WINDOW_STEPS, WINDOW_FRACTION = 10, 1000, 0.25
MIN_TREND_POINTS = 5  # logged losses a trend is fitted to, at the least
PLATEAU_MIN_FALL = 0.001  # a fall of the fitted loss over the window smaller than this fraction of it is no progress
STAGNANT_RATIO = 1e-5  # update / parameter norm per step; ~1e-3 is usual for AdamW and Muon alike
COLLAPSE_FACTOR = 100.0  # the ratio per unit of learning rate fell to 1/this of its peak
STAGNANT_RECORDS = 3  # consecutive logged records a ratio must stay low for
CLIPPED_MOST = 0.5  # clipping on more than this fraction of the window's steps
GROWTH_FACTOR = 10.0  # the window's median gradient norm over the one before's
# The groups of weight matrices, whose ratio says whether the model learns (gains and biases may rightly move
# little): nanopt.train.health_probe names the optimizer's groups so.
MATRIX_GROUPS = ("decay", "muon")


@dataclass(frozen=True)
class HealthSettings:
    """What the judgements depend on, from the run's config."""

    token_rows: int  # the vocabulary rows the softmax covers: a padded model's rows past the data's ids are not
    total_steps: int
    warmup_steps: int
    grad_clip: float
    log_interval: int = 1

    @classmethod
    def from_run(cls, run: Any, token_rows: int | None = None) -> HealthSettings:
        """token_rows: the dataset's id limit the model was built with (None: all of model.json's vocab_size)."""
        t = run.train
        rows = run.model.vocab_size if token_rows is None else min(token_rows, run.model.vocab_size)
        return cls(rows, run.total_steps, t.warmup_steps, t.grad_clip, t.log_interval)

    @property
    def window_steps(self) -> int:
        """The span a trend or a share of clipped steps is judged over: scaled to the run, and never fewer than
        10 logged records."""
        scaled = max(MIN_WINDOW_STEPS, min(MAX_WINDOW_STEPS, round(self.total_steps * WINDOW_FRACTION)))
        return max(scaled, 10 * self.log_interval)

    @property
    def judging_from(self) -> int:
        """The first step at which a window after the warmup is full."""
        return self.warmup_steps + self.window_steps


@dataclass(frozen=True)
class Verdict:
    name: str  # one of VERDICTS
    step: int
    message: str  # what was seen
    advice: str  # the settings that usually fix it

    def line(self) -> str:
        return f"step {self.step}: health: {self.message}; {self.advice}"


def initial_loss_verdict(loss: float, token_rows: int, step: int = 1) -> Verdict | None:
    """A first loss far from ln(token_rows): the uniform prediction a model initialised as configured starts near."""
    expected = math.log(token_rows)
    if math.isfinite(loss) and abs(loss - expected) <= max(1.0, INITIAL_LOSS_TOLERANCE * expected):
        return None
    side = "above" if not math.isfinite(loss) or loss > expected else "below"
    return Verdict("initial_loss", step,
                   f"the first loss {loss:.3f} is far {side} ln({token_rows:,} token ids) = {expected:.3f}, where a "
                   "model initialised as configured starts",
                   "likely causes: the initialisation (model.json initializer_range, 0.02 is usual), a tokenizer "
                   "whose vocabulary does not match vocab_size, or the data (token ids, repeated or empty documents)")


def loss_trend(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(fitted change of the loss over the points' span, its standard error), both as fractions of the mean loss:
    a least-squares line through (step, loss). None with too few points."""
    if len(points) < MIN_TREND_POINTS:
        return None
    steps, losses = [float(s) for s, _ in points], [loss for _, loss in points]
    mean_step, mean_loss = statistics.fmean(steps), statistics.fmean(losses)
    spread = sum((s - mean_step) ** 2 for s in steps)
    if spread == 0 or mean_loss <= 0:
        return None
    slope = sum((s - mean_step) * (x - mean_loss) for s, x in zip(steps, losses, strict=True)) / spread
    residual = sum((x - mean_loss - slope * (s - mean_step)) ** 2 for s, x in zip(steps, losses, strict=True))
    slope_error = math.sqrt(residual / (len(points) - 2) / spread)
    span = steps[-1] - steps[0]
    return slope * span / mean_loss, slope_error * span / mean_loss


@dataclass
class HealthMonitor:
    """Signals and verdicts of one run, fed in step order. Verdicts in `announced` (and those it reaches) are not
    returned again."""

    settings: HealthSettings
    announced: set[str] = field(default_factory=set)
    verdicts: list[Verdict] = field(default_factory=list)
    records: deque = field(default_factory=deque)  # (step, loss, grad_norm, clipped, ratios, lr), two windows' worth
    steps_seen: int = 0  # steps since the last logged record
    steps_clipped: int = 0
    peak_ratio_per_lr: dict[str, float] = field(default_factory=dict)
    low_ratio_records: dict[str, int] = field(default_factory=dict)
    flat_since: int | None = None  # the first step of the current run of judgements that the loss is flat
    _windows: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Two windows of logged records are all any judgement reads: the scans per log line stay that short.
        self.records = deque(self.records, maxlen=2 * self.settings.window_steps // self.settings.log_interval + 2)

    def observe_step(self, step: int, loss: float, grad_norm: float) -> list[Verdict]:
        """Every step: count clipping, and judge the first step's loss."""
        self.steps_seen += 1
        if self.settings.grad_clip > 0 and grad_norm > self.settings.grad_clip:
            self.steps_clipped += 1
        if step == 1:
            return self._new([initial_loss_verdict(loss, self.settings.token_rows, step)])
        return []

    def recall(self, records: list[dict[str, Any]]) -> None:
        """Take the verdicts a run already recorded (its `health` events) as reached: never announced again."""
        for r in records:
            if r.get("kind") == "event" and r.get("event") == "health" and r.get("verdict") in VERDICTS:
                self._new([Verdict(r["verdict"], int(r.get("step") or 0), str(r.get("message")),
                                   str(r.get("advice")))])

    def clipped_fraction(self) -> float | None:
        """The share of steps clipped since the last logged record (None when clipping is off); starts a new count."""
        seen, clipped = self.steps_seen, self.steps_clipped
        self.steps_seen = self.steps_clipped = 0
        if self.settings.grad_clip <= 0 or seen == 0:
            return None
        return clipped / seen

    def observe(self, record: dict[str, Any]) -> list[Verdict]:
        """A logged train record (with the health fields, or without: an older run's). Adds `loss_trend` to it and
        returns the verdicts newly reached."""
        step = int(record["step"])
        while self.records and self.records[-1][0] >= step:  # a rollback: those steps are trained again
            self.records.pop()
        clipped = record.get("clipped_fraction")
        if clipped is None and self.settings.grad_clip > 0 and _number(record.get("grad_norm")):
            clipped = float(record["grad_norm"] > self.settings.grad_clip)  # an older run: its logged steps only
        self._windows = {}
        self.records.append((step, record.get("loss"), record.get("grad_norm"), clipped,
                             record.get("update_ratio") or {}, record.get("lr")))
        trend = loss_trend(self._window_losses(step))
        record["loss_trend"] = None if trend is None else trend[0]
        first = [initial_loss_verdict(record["loss"], self.settings.token_rows)] if step == 1 else []
        if step < self.settings.judging_from:
            self._track_ratios(step, judge=False)
            return self._new(first)
        return self._new([*first, self._plateau(step), self._track_ratios(step, judge=True),
                          self._exploding(step)])

    def summary(self) -> dict[str, Any]:
        """The health section of the end-of-run summary and of eval.json: the verdicts and the latest signals."""
        latest = self.records[-1] if self.records else None
        signals = {}
        if latest is not None:
            step, loss, norm, clipped, ratios, _ = latest
            trend = loss_trend(self._window_losses(step))
            signals = {"step": step, "loss": loss, "grad_norm": norm, "clipped_fraction": clipped,
                       "update_ratio": ratios, "loss_trend": None if trend is None else trend[0],
                       "window_steps": self.settings.window_steps}
        return {"verdicts": [asdict(v) for v in self.verdicts], "signals": signals}

    # ------------------------------------------------------------------------------------------------ judgements

    def _window(self, step: int, offset: int = 0) -> list[tuple]:
        """The records of the window ending `offset` windows before `step` (kept for the judgements of one record:
        each reads the same two windows)."""
        if (step, offset) not in self._windows:
            end = step - offset * self.settings.window_steps
            self._windows[step, offset] = [r for r in self.records if end - self.settings.window_steps < r[0] <= end]
        return self._windows[step, offset]

    def _window_losses(self, step: int) -> list[tuple[int, float]]:
        return [(r[0], r[1]) for r in self._window(step) if _number(r[1])]

    def _plateau(self, step: int) -> Verdict | None:
        """The mean loss of the last window is not below the window before's by more than its noise, and has not
        been for half a window."""
        fall = self._fall(step)
        if fall is None or fall[0] > max(PLATEAU_MIN_FALL, fall[1]):
            self.flat_since = None
            return None
        self.flat_since = step if self.flat_since is None else self.flat_since
        if step - self.flat_since < self.settings.window_steps / 2:
            return None
        window = self.settings.window_steps
        return Verdict("plateau", step,
                       f"the loss has not fallen over the last {window} steps (mean {fall[2]:.4f}, the {window} "
                       f"before {fall[3]:.4f}: {fall[0]:+.2%}, noise {fall[1]:.2%})",
                       "if the update ratio is low too, the learning rate is too small (raise learning_rate, or "
                       "shorten warmup_steps); else a model or data too small, or a schedule at its end")

    def _fall(self, step: int) -> tuple[float, float, float, float] | None:
        """(relative fall of the mean loss from the window before to the last, its standard error, the two means)."""
        now = [loss for _, loss in self._window_losses(step)]
        before = [r[1] for r in self._window(step, offset=1) if _number(r[1])]
        if len(now) < MIN_TREND_POINTS or len(before) < MIN_TREND_POINTS:
            return None
        mean_now, mean_before = statistics.fmean(now), statistics.fmean(before)
        if mean_before <= 0:
            return None
        error = math.sqrt(_variance(now) / len(now) + _variance(before) / len(before))
        return (mean_before - mean_now) / mean_before, error / mean_before, mean_now, mean_before

    def _track_ratios(self, step: int, judge: bool) -> Verdict | None:
        _, _, _, _, ratios, lr = self.records[-1]
        for group in MATRIX_GROUPS:
            ratio = ratios.get(group)
            if not _number(ratio):
                continue
            per_lr = ratio / lr if _number(lr) and lr > 0 else None
            if per_lr is not None and judge:
                self.peak_ratio_per_lr[group] = max(self.peak_ratio_per_lr.get(group, 0.0), per_lr)
            peak = self.peak_ratio_per_lr.get(group)
            collapsed = per_lr is not None and peak is not None and per_lr < peak / COLLAPSE_FACTOR
            low = ratio < STAGNANT_RATIO or collapsed
            self.low_ratio_records[group] = self.low_ratio_records.get(group, 0) + 1 if low else 0
            if judge and self.low_ratio_records[group] >= STAGNANT_RECORDS:
                how = (f"{ratio:.1e}, far below the usual ~1e-3" if ratio < STAGNANT_RATIO else
                       f"{ratio:.1e}, a hundredth of its peak per unit of learning rate")
                return Verdict("stagnating_updates", step,
                               f"the update-to-parameter norm ratio of the {group} group is {how}: the weights "
                               "barely move",
                               "raise learning_rate (muon_learning_rate for Muon), check warmup_steps and the "
                               "schedule, and a weight_decay that is not pinning the weights")
        return None

    def _exploding(self, step: int) -> Verdict | None:
        window = self._window(step)
        clipped = [r[3] for r in window if _number(r[3])]
        share = statistics.fmean(clipped) if clipped else None
        if share is not None and len(clipped) >= MIN_TREND_POINTS and share > CLIPPED_MOST:
            return Verdict("exploding_gradients", step,
                           f"gradients clipped on {share:.0%} of the last {self.settings.window_steps} steps "
                           f"(grad_clip {self.settings.grad_clip:g})", _EXPLODING_ADVICE)
        now = [r[2] for r in window if _number(r[2])]
        before = [r[2] for r in self._window(step, offset=1) if _number(r[2]) and r[0] >= self.settings.warmup_steps]
        if len(now) >= MIN_TREND_POINTS and len(before) >= MIN_TREND_POINTS:
            growth = statistics.median(now) / max(statistics.median(before), 1e-12)
            if growth > GROWTH_FACTOR:
                return Verdict("exploding_gradients", step,
                               f"the gradient norm grew {growth:.0f}x over the last {self.settings.window_steps} "
                               "steps", _EXPLODING_ADVICE)
        return None

    def _new(self, verdicts: list[Verdict | None]) -> list[Verdict]:
        fresh = []
        for verdict in verdicts:
            if verdict is not None and verdict.name not in self.announced:
                self.announced.add(verdict.name)
                self.verdicts.append(verdict)
                fresh.append(verdict)
        return fresh


_EXPLODING_ADVICE = ("lower learning_rate (by 2-10x), lengthen warmup_steps, and check precision (fp16 overflows: "
                     "bf16) and grad_clip (1.0 is usual)")


def _variance(values: list[float]) -> float:
    """The sample variance (statistics.variance computes exactly with fractions: far slower, per log line)."""
    mean = sum(values) / len(values)
    return sum((x - mean) ** 2 for x in values) / (len(values) - 1)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def replay(records: list[dict[str, Any]], settings: HealthSettings) -> HealthMonitor:
    """The monitor after a run's metrics.jsonl records (a finished or a running run): the verdicts it recorded
    (the first step's is only seen live, unless step 1 was logged) and those its train records reach."""
    monitor = HealthMonitor(settings)
    monitor.recall(records)
    for record in records:
        if record.get("kind") == "train" and _number(record.get("step")):
            monitor.observe(dict(record))
    return monitor
