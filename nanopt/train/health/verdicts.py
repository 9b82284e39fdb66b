"""Run health: the signals that say a run is going wrong, and the verdicts a person can act on.

Pure arithmetic on numbers (no torch). Every signal is per optimizer step, or judged over windows of steps, never
of log records, so a run gets the same verdicts whatever its log_interval:
- each step's loss and gradient norm (before clipping) go into blocks of consecutive steps
  (nanopt.train.health.window), a fortieth of the run each (1 to 100 steps); each block is judged when it ends, over the
  last window (ten blocks: a quarter of the run, 10 to 1,000 steps) against the window before;
- the update-to-parameter ratio is measured at log steps only (it copies the weights): a window's level is the
  median of the medians of its blocks' measurements, judged once three blocks of the window hold one.
Training writes each block into its next logged train record (`health_blocks`), so `nanopt eval --health` replays
the very numbers training judged (a run written before blocks existed is replayed from its logged steps).

Verdicts, each announced once per run (a resumed run reads the `health` events it already wrote). Where the advice
would change a setting, the message gives the numbers seen and the steps they were seen over; the `health` event
carries them as `evidence`.
- initial_loss: the first step's loss is far from ln(token rows), where a model initialised as configured starts
  (the rows of a vocabulary padded past the tokenizer's ids are out of the softmax: ln(vocab_size) would be wrong).
- plateau: the mean loss of the last window is not below the window before's by more than its noise (one
  standard error of the difference of the means) and 0.1%, for half a window.
- stagnating_updates: the weight matrices' update ratio is far below the usual ~1e-3 (under 1e-5), or fell to a
  hundredth of its peak per unit of learning rate.
- exploding_gradients: the gradient norm's level grew tenfold over its level a window before, or stays above ten
  times grad_clip. Clipping near the threshold is no verdict: a small model's norm hovers around 1 early in
  training, and clipping at 1.0 trims it, as intended.
The judgements after step 1 wait for the warmup and one window (a run's first steps are always unruly), but for a
gradient norm far above the clip, judged from the warmup's end (over a full window): a learning rate of 5 on the
demo overflows the norm a few steps later, before that window would be full.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

from nanopt.train.health.window import Block, RatioBins, WindowStats, finite, loss_fall

VERDICTS = ("initial_loss", "plateau", "stagnating_updates", "exploding_gradients")

INITIAL_LOSS_TOLERANCE = 0.2  # far off: more than this fraction of ln(vocab) (and at least a nat) away from it
# A window is a quarter of the run (long enough for a trend to show through the noise of single batches, short
# enough to say so in time), cut into ten blocks: a level from ten medians shrugs off a spike.
WINDOW_FRACTION, BLOCKS_PER_WINDOW, MAX_BLOCK_STEPS = 0.25, 10, 100
MIN_BLOCKS = 5  # blocks (with a loss, a norm or a ratio) a window needs to be judged
PLATEAU_MIN_FALL = 0.001  # a fall of the mean loss smaller than this fraction of it is no progress
# Update / parameter norm per step: ~1e-3 is usual for AdamW and Muon alike; the demo's weight matrices sit at
# 2e-3..3e-2. Under 1e-5 the weights barely move (a learning rate of 1e-7 gives ~1e-7).
STAGNANT_RATIO = 1e-5
COLLAPSE_FACTOR = 100.0  # the ratio per unit of learning rate fell to 1/this of its peak: a schedule does not
MIN_RATIO_BLOCKS = 3  # blocks with a ratio measured in them a window needs: logging every 50 steps of a 150-step
#                       run measures too seldom to judge, and says nothing rather than guess
# The gradient norm's level, the median of its blocks' medians: growth over the window before's (clipping hides
# growth from the loss, not from the norm measured before it), and a level that stays far above grad_clip. The
# demo's healthy level after warmup: 0.5-1.3 with grad_clip 1.0, 0.5x-1.6x its level a window before; a learning
# rate of 5 puts it at 10^2-10^4 (or overflows it).
GROWTH_FACTOR = 10.0
FAR_ABOVE_CLIP = 10.0


@dataclass(frozen=True)
class HealthSettings:
    """What the judgements depend on, from the run's config: never its log_interval."""

    token_rows: int  # the vocabulary rows the softmax covers: a padded model's rows past the data's ids are not
    total_steps: int
    warmup_steps: int
    grad_clip: float

    @classmethod
    def from_run(cls, run: Any, token_rows: int | None = None) -> HealthSettings:
        """token_rows: the dataset's id limit the model was built with (None: all of model.json's vocab_size)."""
        t = run.train
        rows = run.model.vocab_size if token_rows is None else min(token_rows, run.model.vocab_size)
        return cls(rows, run.total_steps, t.warmup_steps, t.grad_clip)

    @cached_property
    def block_steps(self) -> int:
        return max(1, min(MAX_BLOCK_STEPS, round(self.total_steps * WINDOW_FRACTION / BLOCKS_PER_WINDOW)))

    @cached_property
    def window_steps(self) -> int:
        """The span a trend or a level is judged over: a quarter of the run, 10 to 1,000 steps."""
        return self.block_steps * BLOCKS_PER_WINDOW

    @property
    def judging_from(self) -> int:
        """The first step at which a window after the warmup is full."""
        return self.warmup_steps + self.window_steps

    def ends_block(self, step: int) -> bool:
        return step % self.block_steps == 0 or step == self.total_steps


@dataclass(frozen=True)
class Verdict:
    name: str  # one of VERDICTS
    step: int
    message: str  # what was seen, with its numbers
    advice: str  # the settings that usually fix it
    evidence: dict[str, Any] = field(default_factory=dict)  # the message's numbers, for a program

    def line(self) -> str:
        return f"step {self.step}: health: {self.message}; {self.advice}"


def initial_loss_verdict(loss: float, token_rows: int, step: int = 1) -> Verdict | None:
    """A first loss far from ln(token_rows): the uniform prediction a model initialised as configured starts near."""
    expected = math.log(token_rows)
    if finite(loss) and abs(loss - expected) <= max(1.0, INITIAL_LOSS_TOLERANCE * expected):
        return None
    side = "above" if not finite(loss) or loss > expected else "below"
    return Verdict("initial_loss", step,
                   f"the first loss {loss:.3f} is far {side} ln({token_rows:,} token ids) = {expected:.3f}, where a "
                   "model initialised as configured starts",
                   "likely causes: the initialisation (model.json initializer_range, 0.02 is usual), a tokenizer "
                   "whose vocabulary does not match vocab_size, or the data (token ids, repeated or empty documents)",
                   {"loss": loss, "expected": expected, "token_rows": token_rows})


def loss_trend(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(fitted change of the loss over the points' span, its standard error), both as fractions of the mean loss:
    a least-squares line through (step, loss). None with too few points."""
    if len(points) < MIN_BLOCKS:
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
    """Signals and verdicts of one run, fed in step order: every step (`observe_step`, in training) or the blocks
    a run recorded (`observe_block`, in a replay), and each logged train record (`observe`). Memory: four windows
    of blocks and of ratio medians, and one open block of at most 100 steps. Verdicts in `announced` (and those it
    reaches) are not returned again."""

    settings: HealthSettings
    announced: set[str] = field(default_factory=set)
    verdicts: list[Verdict] = field(default_factory=list)
    recorded: set[str] = field(default_factory=set)  # verdicts the run's own `health` events gave
    pending: list[Block] = field(default_factory=list)  # blocks ended since the last logged record
    flat_since: int | None = None  # the first step of the current run of judgements that the loss is flat
    peak_ratio_per_lr: dict[str, float] = field(default_factory=dict)
    latest: dict[str, Any] = field(default_factory=dict)  # the latest logged record's signals
    last_step: int = 0

    def __post_init__(self) -> None:
        # Four windows: two are judged, the rest absorbs blocks cut shorter by a resume or a changed max_steps.
        self.blocks: deque[Block] = deque(maxlen=4 * BLOCKS_PER_WINDOW)
        self.ratios = RatioBins(self.settings.block_steps, keep=4 * BLOCKS_PER_WINDOW)
        self.samples: list[tuple[int, float, float]] = []  # the open block's (step, loss, norm)

    def observe_step(self, step: int, loss: float, grad_norm: float) -> list[Verdict]:
        """Every step trained (in training): the first step's loss is judged, and a block that ends is judged."""
        self._rewind(step)
        self.samples.append((step, loss, grad_norm))
        found = [initial_loss_verdict(loss, self.settings.token_rows, step)] if step == 1 else []
        if self.settings.ends_block(step):
            block = self._close_block()
            self.pending.append(block)
            return self._new([*found, *self._judge(block)])
        return self._new(found)

    def take_pending(self) -> list[dict[str, Any]]:
        """The blocks ended since the last logged record, as its `health_blocks`."""
        taken, self.pending = self.pending, []
        return [block.record() for block in taken]

    def observe_block(self, block: Block) -> list[Verdict]:
        """A block a run recorded (in a replay); one out of step order is passed over."""
        if self.blocks and block.first <= self.blocks[-1].last:
            return []
        self.blocks.append(block)
        return self._new(self._judge(block))

    def observe_samples(self, step: int, loss: Any, grad_norm: Any) -> list[Verdict]:
        """A logged step of a run that recorded no blocks (before they existed): its loss and norm stand for the
        steps around it, cut on the same grid."""
        if self.samples and (step - 1) // self.settings.block_steps != (self.samples[-1][0] - 1) // \
                self.settings.block_steps:
            verdicts = self.observe_block(self._close_block(keep=False))
        else:
            verdicts = []
        self.samples.append((step, loss, grad_norm))
        if self.settings.ends_block(step):
            verdicts += self.observe_block(self._close_block(keep=False))
        return verdicts

    def observe(self, record: dict[str, Any]) -> None:
        """A logged train record (in training): its ratios are measured, and its `loss_trend` added."""
        self._measured(record)
        record["loss_trend"] = self._trend(record["step"])

    def _measured(self, record: dict[str, Any]) -> None:
        ratios = record.get("update_ratio")
        self.ratios.add(record["step"], ratios if isinstance(ratios, dict) else {}, record.get("lr"))
        self.latest = {k: record.get(k) for k in ("step", "loss", "grad_norm", "update_ratio")}

    def _trend(self, step: int) -> float | None:
        """The fitted change of the loss over the last window's blocks, as a fraction of its mean."""
        trend = loss_trend([(b.middle, b.loss_sum / b.losses) for b in self._window(step) if b.losses])
        return None if trend is None else trend[0]

    def read(self, record: dict[str, Any]) -> None:
        """One record of metrics.jsonl, in a replay: a `health` event is recalled, a train record's blocks judged
        and its ratios measured."""
        if record.get("kind") == "event" and record.get("event") == "health":
            self.recall(record)
            return
        step = record.get("step")
        if record.get("kind") != "train" or type(step) is not int or step < 1:
            return
        self._rewind(step)
        if step == 1 and (isinstance(record.get("loss"), float) or finite(record.get("loss"))):  # NaN: a verdict
            self._new([initial_loss_verdict(record["loss"], self.settings.token_rows)])
        blocks = record.get("health_blocks")
        if isinstance(blocks, list):
            for block in blocks:
                if (parsed := Block.from_record(block)) is not None and parsed.last <= step:
                    self.observe_block(parsed)
        elif finite(record.get("grad_norm")):
            self.observe_samples(step, record.get("loss"), record["grad_norm"])
        self._measured(record)

    def recall(self, record: dict[str, Any]) -> None:
        """A `health` event the run wrote: its verdict is reached, never announced again, and shown as recorded."""
        name = record.get("verdict")
        if name not in VERDICTS or name in self.recorded:
            return
        step = record.get("step")
        evidence = record.get("evidence")
        verdict = Verdict(name, step if type(step) is int else 0, str(record.get("message")),
                          str(record.get("advice")), evidence if isinstance(evidence, dict) else {})
        self.recorded.add(name)
        self.verdicts = [v for v in self.verdicts if v.name != name] + [verdict]
        self.announced.add(name)

    def forget_unrecorded(self) -> None:
        """Keep only the verdicts the run recorded (a resume: one a replay reached but the run never said is said
        when the resumed run reaches it)."""
        self.verdicts = [v for v in self.verdicts if v.name in self.recorded]
        self.announced = set(self.recorded)

    def summary(self) -> dict[str, Any]:
        """The health section of the end-of-run summary and of eval.json: the verdicts and the latest signals."""
        signals = {}
        if self.latest:
            window = self._window(self.latest["step"])
            stats = WindowStats.of(window) if window else None
            signals = {**self.latest, "loss_trend": self._trend(self.latest["step"]),
                       "window_steps": self.settings.window_steps,
                       "grad_norm_level": None if stats is None else stats.norm_median,
                       "clipped_share": None if stats is None else stats.clipped_share}
        return {"verdicts": [asdict(v) for v in self.verdicts], "signals": signals}

    # ------------------------------------------------------------------------------------------------ blocks

    def _rewind(self, step: int) -> None:
        """A step at or before one seen: a rollback, whose steps are trained again. What they measured goes."""
        if step <= self.last_step:
            self.samples = [s for s in self.samples if s[0] < step]
            self.pending = [b for b in self.pending if b.last < step]
            while self.blocks and self.blocks[-1].last >= step:
                self.blocks.pop()
            self.ratios.rewind(step)
            if self.flat_since is not None and self.flat_since >= step:
                self.flat_since = None
        self.last_step = step

    def _close_block(self, keep: bool = True) -> Block:
        block = Block.of(self.samples, self.settings.grad_clip)
        self.samples = []
        if keep:
            self.blocks.append(block)
        return block

    def _window(self, end: int, offset: int = 0) -> list[Block]:
        """The blocks of the window ending `offset` windows before step `end`."""
        last = end - offset * self.settings.window_steps
        return [b for b in self.blocks if last - self.settings.window_steps < b.last <= last]

    def _judge(self, block: Block) -> list[Verdict | None]:
        if block.last < max(self.settings.window_steps, self.settings.warmup_steps):
            return []
        now, before = self._window(block.last), self._window(block.last, offset=1)
        exploding = self._exploding(block.last, now, before)
        if block.last < self.settings.judging_from:  # a level far above the clip is judged from the warmup's end
            return [exploding]
        return [self._plateau(block.last, now, before), self._stagnating(block.last), exploding]

    def _new(self, verdicts: list[Verdict | None]) -> list[Verdict]:
        fresh = []
        for verdict in verdicts:
            if verdict is not None and verdict.name not in self.announced:
                self.announced.add(verdict.name)
                self.verdicts.append(verdict)
                fresh.append(verdict)
        return fresh

    # ------------------------------------------------------------------------------------------------ judgements

    def _plateau(self, step: int, now: list[Block], before: list[Block]) -> Verdict | None:
        """The mean loss of the last window is not below the window before's by more than its noise, and has not
        been for half a window."""
        fall = loss_fall(now, before, MIN_BLOCKS)
        if fall is None or fall[0] > max(PLATEAU_MIN_FALL, fall[1]):
            self.flat_since = None
            return None
        self.flat_since = step if self.flat_since is None else self.flat_since
        if step - self.flat_since < self.settings.window_steps / 2:
            return None
        change, noise, a, b = fall
        return Verdict("plateau", step,
                       f"the loss has not fallen since step {self.flat_since}: mean {a.loss_mean:.4f} over {a.span} "
                       f"against {b.loss_mean:.4f} over {b.span} ({-change:+.2%}, noise {noise:.2%})",
                       "if the update ratio is low too, the learning rate is too small (raise learning_rate, or "
                       "shorten warmup_steps); else a model or data too small, or a schedule at its end",
                       {"loss_mean": a.loss_mean, "steps": [a.first, a.last], "before_loss_mean": b.loss_mean,
                        "before_steps": [b.first, b.last], "fall": change, "noise": noise,
                        "flat_since": self.flat_since})

    def _stagnating(self, step: int) -> Verdict | None:
        first = step - self.settings.window_steps + 1
        for group, (blocks, ratio, per_lr) in self.ratios.window(first, step).items():
            if blocks < MIN_RATIO_BLOCKS:
                continue
            peak = self.peak_ratio_per_lr.get(group, 0.0)
            self.peak_ratio_per_lr[group] = max(peak, per_lr)
            evidence = {"group": group, "ratio_median": ratio, "ratio_per_lr_median": per_lr,
                        "peak_ratio_per_lr": peak, "steps": [first, step], "blocks_measured": blocks}
            if ratio < STAGNANT_RATIO:
                how = "far below the usual ~1e-3"
            elif per_lr < peak / COLLAPSE_FACTOR:
                how = f"{per_lr:.3g} per unit of learning rate: under a hundredth of its peak {peak:.3g}"
            else:
                continue
            return Verdict("stagnating_updates", step,
                           f"the update-to-parameter norm ratio of the {group} group has a median of {ratio:.1e} "
                           f"over steps {first}-{step}, {how}: the weights barely move",
                           "raise learning_rate (muon_learning_rate for Muon), check warmup_steps and the schedule, "
                           "and a weight_decay that is not pinning the weights", evidence)
        return None

    def _exploding(self, step: int, now: list[Block], before: list[Block]) -> Verdict | None:
        before = [b for b in before if b.first > self.settings.warmup_steps]
        if len(now) < MIN_BLOCKS:
            return None
        a = WindowStats.of(now)
        clip = self.settings.grad_clip
        seen = (f"the gradient norm's median is {_norm(a.norm_median)} over {a.span} (grad_clip {clip:g}, "
                f"clipped on {a.clipped_share:.0%} of those steps)")
        evidence = {"norm_median": a.norm_median, "steps": [a.first, a.last], "grad_clip": clip,
                    "clipped_share": a.clipped_share}
        if len(before) >= MIN_BLOCKS:
            b = WindowStats.of(before)
            evidence |= {"before_norm_median": b.norm_median, "before_steps": [b.first, b.last]}
            if a.norm_median > GROWTH_FACTOR * b.norm_median:
                return Verdict("exploding_gradients", step,
                               f"{seen}, over {GROWTH_FACTOR:g}x its median {_norm(b.norm_median)} over {b.span}",
                               _EXPLODING_ADVICE, evidence)
        if clip > 0 and a.norm_median > FAR_ABOVE_CLIP * clip:
            return Verdict("exploding_gradients", step, f"{seen}: over {FAR_ABOVE_CLIP:g}x grad_clip",
                           _EXPLODING_ADVICE, evidence)
        return None


_EXPLODING_ADVICE = ("lower learning_rate (by 2-10x), lengthen warmup_steps, and check precision (fp16 overflows: "
                     "bf16) and grad_clip (1.0 is usual)")


def _norm(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "not finite"


def replay(records: Iterable[dict[str, Any]], settings: HealthSettings) -> HealthMonitor:
    """The monitor after a run's metrics.jsonl records, read once, in order (a finished or a running run): the
    verdicts it recorded and those its blocks (or, in a run older than them, its logged steps) reach. The first
    step's loss is judged only when step 1 was logged."""
    monitor = HealthMonitor(settings)
    for record in records:
        monitor.read(record)
    return monitor
