"""The state a checkpoint carries besides weights and optimizer moments, as one object.

`TrainState.state_dict()` is everything the loop needs to continue exactly: the counters, this rank's loader
position and every RNG. Adding a field here adds it to save and load at once; nothing else lists them.

In meta.json the counters are run-wide (rank 0's, identical on every rank) and the loader and RNG states are
per rank (`ranks[i]`), so a checkpoint can be resumed on another world size: the loader position is global, the
RNG streams are restored only when the world size is the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from nanopt.rng import rng_state, set_rng_state
from nanopt.train.precision.scaling import load_scaler_state, scaler_state


@dataclass
class Counters:
    """Where the loop stands. Saved: all but the ones that describe this session only."""

    step: int = 0  # optimizer steps completed
    tokens: int = 0
    last_val_loss: float | None = None
    val_step: int | None = None  # the step last_val_loss was measured at: a checkpoint is `best` only at that step
    best_val_loss: float | None = None
    skipped_steps: int = 0
    last_loss: float | None = None
    # automatic rollbacks so far (nanopt.train.guard.recovery), so max_recoveries holds across resumes
    recoveries: int = 0
    lr_ramp_start: int = 0  # the step the latest rollback went back to: the learning-rate ramp starts there ...
    lr_ramp_factor: float = 1.0  # ... from this multiplier of the schedule's rate (1: no ramp)
    # this session only
    consecutive_nonfinite: int = 0
    last_checkpoint_step: int = -1

    SESSION_ONLY = ("consecutive_nonfinite", "last_checkpoint_step")
    RECOVERY = ("recoveries", "lr_ramp_start", "lr_ramp_factor")  # meta.json's `recovery` (absent before it existed)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in self.SESSION_ONLY}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in state and f.name not in self.SESSION_ONLY:
                setattr(self, f.name, state[f.name])
        self.last_checkpoint_step = self.step


class TrainState:
    """Counters + this rank's loader + RNG: what a checkpoint holds besides the tensors."""

    def __init__(self, loader: Any, scaler: Any = None) -> None:
        self.counters = Counters()
        self.loader = loader
        self.scaler = scaler  # fp16's torch.amp.GradScaler (nanopt.train.precision.scaling), else None

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part: gathered from every rank into meta.json's `ranks` list."""
        return {"loader": self.loader.state_dict(), "rng": rng_state()}

    def state_dict(self, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The meta.json fields, given every rank's `rank_state_dict()` in rank order."""
        c = self.counters
        scale = {"loss_scale": scaler_state(self.scaler)} if self.scaler is not None else {}
        return {**scale, "step": c.step, "tokens": c.tokens, "best_val_loss": c.best_val_loss,
                "skipped_steps": c.skipped_steps, "ranks": rank_states,
                "recovery": {key: getattr(c, key) for key in Counters.RECOVERY},
                "metrics": {"train_loss": c.last_loss, "val_loss": c.last_val_loss, "val_step": c.val_step}}

    def load_state_dict(self, meta: dict[str, Any], rank: int, world_size: int) -> None:
        metrics = meta.get("metrics") or {}
        self.counters.load_state_dict({
            "step": int(meta["step"]), "tokens": int(meta["tokens"]), "best_val_loss": meta.get("best_val_loss"),
            "skipped_steps": int(meta.get("skipped_steps", 0)), "last_val_loss": metrics.get("val_loss"),
            "val_step": metrics.get("val_step"),
            "last_loss": metrics.get("train_loss"), **(meta.get("recovery") or {})})
        if self.scaler is not None and meta.get("loss_scale") is not None:  # absent: a checkpoint of a bf16 run
            load_scaler_state(self.scaler, meta["loss_scale"])
        ranks = meta["ranks"]
        self.loader.load_state_dict(ranks[min(rank, len(ranks) - 1)]["loader"])
        if len(ranks) == world_size:  # the same ranks: the same random streams (dropout) continue
            set_rng_state(ranks[rank]["rng"])
