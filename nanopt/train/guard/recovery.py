"""Automatic recovery: a run that spikes or diverges rolls back to a checkpoint from before it and goes on.

A spike is confirmed after `recovery_confirm_steps` consecutive steps whose loss is more than `spike_threshold`
standard deviations above the rolling mean and above every loss in the window; a divergence is
`max_nonfinite_steps` non-finite steps in a row. Then every rank together loads the newest complete checkpoint from
before the weights that gave the first bad step, leaves the data position past the batches read since (plus
`recovery_skip_steps` more steps' worth), multiplies the learning rate by `recovery_lr_factor` and ramps it back
over `recovery_lr_steps` steps (nanopt.train.optim.schedule.recovery_lr_multiplier, saved in the checkpoint's counters),
and trains on. After `max_recoveries` rollbacks, or with no checkpoint from before the trouble, the run stops with
TrainingDiverged. No periodic checkpoint is saved while a spike is unconfirmed, so the one before it is kept.

Every decision here is taken from the loss all-reduced in the step (the same on every rank) and from rank 0's
choice of checkpoint, broadcast: every rank always takes the same branch and enters the same collectives.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

from nanopt.errors import CheckpointError
from nanopt.runtime import broadcast_object
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint.resume import load_checkpoint
from nanopt.train.checkpoint.save import wait_for_save
from nanopt.train.optim.schedule import recovery_lr_multiplier
from nanopt.train.session import Session
from nanopt.train.step import TrainingDiverged, diverged
from nanopt.untrusted_text import shell_word


class SpikeWatch:
    """Counts consecutive spiking steps. Spiking losses stay out of the window, so a long spike does not raise its
    own bar; non-finite losses are the divergence check's (nanopt.train.step) and change nothing here."""

    def __init__(self, threshold: float, confirm_steps: int, history: list[float], window: int = 50,
                 min_history: int = 20) -> None:
        self.threshold, self.confirm_steps, self.min_history = threshold, confirm_steps, min_history
        self.history: deque[float] = deque(history, maxlen=window)
        self.spiking: list[tuple[int, float]] = []  # (step, loss) of the current run of spiking steps

    def observe(self, step: int, loss: float) -> bool:
        """Record the loss of step `step`; True when it confirms a spike."""
        if not math.isfinite(loss):
            return False
        if self._is_spike(loss):
            self.spiking.append((step, loss))
            return len(self.spiking) >= self.confirm_steps
        self.spiking.clear()
        self.history.append(loss)
        return False

    def _is_spike(self, loss: float) -> bool:
        if len(self.history) < self.min_history:
            return False
        mean = sum(self.history) / len(self.history)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
        return loss > max(self.history) and (loss - mean) / max(std, 1e-6) > self.threshold

    @property
    def mean(self) -> float | None:
        return sum(self.history) / len(self.history) if self.history else None


def start_watching(s: Session) -> None:
    """Give the session its SpikeWatch (recovery on), seeded with rank 0's losses from before the checkpoint it
    resumed from (nanopt.train.checkpoint.resume restores them on rank 0), so every rank watches the same window."""
    if not s.run.train.recovery:
        return
    history = broadcast_object(s.rt, list(s.spikes.history) if s.spikes is not None else [])
    s.spike_watch = SpikeWatch(s.run.train.spike_threshold, s.run.train.recovery_confirm_steps, history)


def recover_if_needed(s: Session, loss: float) -> bool:
    """After a step: roll back when it confirmed a spike or a divergence (True), else nothing (False)."""
    if s.spike_watch is None:
        return False
    st = s.state
    if st.consecutive_nonfinite >= s.run.train.max_nonfinite_steps:
        first_bad = st.step - st.consecutive_nonfinite + 1
        roll_back(s, "nonfinite", first_bad, loss, f"{st.consecutive_nonfinite} non-finite steps in a row at step "
                                                   f"{st.step}")
        return True
    if st.consecutive_nonfinite:  # a skipped step's loss says nothing about the weights' health
        return False
    if s.spike_watch.observe(st.step, loss):
        first_bad = s.spike_watch.spiking[0][0]
        what = f"loss spike from step {first_bad} to {st.step} (loss {loss:.4f}, rolling mean {s.spike_watch.mean:.4f})"
        roll_back(s, "spike", first_bad, loss, what)
        return True
    return False


def spike_pending(s: Session) -> bool:
    """Whether the latest steps spiked but have not yet confirmed a spike: a checkpoint now would hold their weights,
    and could push the one from before them out of keep_checkpoints."""
    return s.spike_watch is not None and bool(s.spike_watch.spiking)


def roll_back(s: Session, reason: str, first_bad: int, loss: float, what: str) -> None:
    """Load the newest checkpoint before step `first_bad`, skip the data read since, lower the learning rate, and
    record it; TrainingDiverged when max_recoveries is spent or no such checkpoint exists."""
    st, cfg = s.state, s.run.train
    if st.recoveries >= cfg.max_recoveries:
        raise diverged(s, f"{what}, after {st.recoveries} automatic recoveries (max_recoveries)")
    wait_for_save(s)  # a checkpoint still being written may be the one to roll back to, and must not move `latest`
    # The loss of step k is measured on the weights step k - 1 left, and the checkpoint of step k - 1 holds them.
    target = _checkpoint_before(s, first_bad - 1)
    if target is None and first_bad <= 2:  # the weights it needs are the initial ones, which are never saved
        raise _nothing_to_roll_back(s, what, first_bad)
    if target is None:
        raise diverged(s, f"{what}, and no complete checkpoint from step {first_bad - 2} or earlier to roll back to")
    spike_step, loader_step, recoveries = st.step, s.loader.step, st.recoveries + 1
    lr_factor = cfg.recovery_lr_factor * recovery_lr_multiplier(st.step, st.lr_ramp_start, st.lr_ramp_factor,
                                                                 cfg.recovery_lr_steps)
    load_checkpoint(s, target)
    skipped_samples = _skip_data(s, loader_step + cfg.recovery_skip_steps)
    st.recoveries, st.lr_ramp_start, st.lr_ramp_factor = recoveries, target.step, lr_factor
    st.consecutive_nonfinite = 0
    s.spike_watch.spiking.clear()
    if s.rt.is_main:  # `latest` must not name a checkpoint written during the trouble
        ckpt.write_pointer(s.paths.checkpoints, "latest", target.path.name)
    s.metrics.truncate_after(target.step)  # the steps after the checkpoint are trained again
    s.metrics.write("event", step=spike_step, event="recovery", to_step=target.step, skipped_samples=skipped_samples,
                    lr_factor=lr_factor, reason=reason, loss=loss, recovery=recoveries,
                    max_recoveries=cfg.max_recoveries, detail=what, checkpoint=target.path.name)
    s.observer.note(f"step {spike_step}: {what}; recovery {recoveries} of {cfg.max_recoveries}: rolled back to "
                    f"{target.path.name}, skipped {skipped_samples:,} samples, learning rate x{lr_factor:g} ramping "
                    f"back over {cfg.recovery_lr_steps} steps")


def _nothing_to_roll_back(s: Session, what: str, first_bad: int) -> TrainingDiverged:
    """The trouble began at step 1 or 2: the weights from before it are the initial ones, which no checkpoint holds.
    At step 1 the loss and gradient are the initial weights' own: no learning rate has acted yet."""
    if first_bad > 1:
        return TrainingDiverged(
            f"training diverged: {what}, the first at step {first_bad}: no checkpoint is from before it (the initial "
            "weights are never saved), nothing to roll back to",
            f"start again with a lower learning rate, e.g. `nanopt train {shell_word(s.run.run_dir)} --resume none "
            f"--set learning_rate={s.run.train.learning_rate / 10:g}`")
    return TrainingDiverged(
        f"training diverged: {what}, the first at step 1, before any checkpoint exists: nothing to roll back to",
        "at step 1 the loss and gradient are the initial weights' (no learning rate has acted yet): look at the "
        "precision (fp16 overflows: bf16 or fp32), the initialization in model.json (initializer_range, eps), and "
        "the data (token ids, degenerate batches); a learning rate far too high shows from step 2 on")


def _checkpoint_before(s: Session, step_limit: int) -> ckpt.Checkpoint | None:
    """The newest complete, verified checkpoint whose step is before `step_limit`: rank 0 picks it, every rank
    loads the same one."""
    chosen = None
    if s.rt.is_main:
        for step, path in reversed(ckpt.step_dirs(s.run.run_dir)):
            found = _verified(path) if step < step_limit else None
            # A weights-only checkpoint (the imported weights) is the run's initial state, which a rollback never
            # targets (see roll_back): it has no optimizer or loader state to return to.
            if found is not None and found.meta.get("weights_only") is not True:
                chosen = str(path)
                break
    chosen = broadcast_object(s.rt, chosen)
    return None if chosen is None else ckpt.verify_discovered(Path(chosen))


def _verified(path: Path) -> Any:
    try:
        return ckpt.verify_discovered(path)
    except CheckpointError:
        return None


def _skip_data(s: Session, loader_step: int) -> int:
    """Move the loader (just restored to the checkpoint's position) to the start of optimizer step `loader_step`'s
    batches; returns the samples passed over (the same global count on every rank)."""
    before = s.loader.step
    s.loader.seek(loader_step)
    return s.loader.first_sample_of(loader_step) - s.loader.first_sample_of(before)
