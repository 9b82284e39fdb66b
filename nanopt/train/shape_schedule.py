"""What training and the tools that time it (preflight, profile) need to know of batch-size warmup
(nanopt.config.batch_ramp), kept out of the loop: how many steps a span of tokens was, the start-up line's words,
and a session moved past the ramp so it times full-size steps."""

from __future__ import annotations

from typing import Any

from nanopt.config import TrainConfig


def steps_in(cfg: TrainConfig, tokens: int) -> int:
    """The optimizer steps that train exactly `tokens` tokens from the run's start (every step has tokens, so the
    inverse of TrainConfig.tokens_before)."""
    ramp = cfg.batch_ramp
    return tokens // cfg.global_batch_tokens if ramp is None else ramp.steps_for(tokens)


def step_times(cfg: TrainConfig, seconds: float, tokens_before: int, tokens_after: int) -> tuple[float, float]:
    """(the mean step, and a full-size step at that speed) over a span of training from `tokens_before` to
    `tokens_after` tokens: the same without batch warmup; during it the steps are shorter, and the time left (a
    count of full-size steps, nanopt.train.phases.projected_seconds) needs the second."""
    steps = max(1, steps_in(cfg, tokens_after) - steps_in(cfg, tokens_before))
    return seconds / steps, seconds * cfg.global_batch_tokens / max(1, tokens_after - tokens_before)


def warmup_note(cfg: TrainConfig) -> str:
    """', after batch warmup from S tokens over the first N tokens (K steps)', or '' without one."""
    ramp = cfg.batch_ramp
    if ramp is None:
        return ""
    return (f", after batch warmup from {ramp.start_tokens:,} tokens over the first "
            f"{ramp.levels[-1].tokens_before:,} tokens ({ramp.ramp_steps:,} steps)")


def skip_the_ramp(session: Any) -> None:
    """Start `session` (not yet stepped, writing nothing) at the run's first full-size step, so what is timed is the
    step that takes most of the run (a ramp's steps run fewer micro-batches of the same shape: the same memory,
    less time). Nothing without batch warmup."""
    cfg = session.run.train
    if cfg.batch_ramp is None:
        return
    first_full = min(cfg.batch_ramp.ramp_steps, max(0, session.total_steps - 1))
    loader = session.loader
    loader.load_state_dict({**loader.state_dict(), "step": first_full, "micro_step": 0})
    session.state.step, session.state.tokens = first_full, cfg.tokens_before(first_full)
