"""What training and the tools that time it (preflight, profile) need to know of batch-size warmup
(nanopt.config.batch_ramp) and of sequence-length stages (nanopt.config.seq_stages), kept out of the loop: how many
steps a span of tokens was, the start-up line's words, the FLOPs of a token over the stages, and a session moved to
the step it should time (past the ramp, into the longest stage)."""

from __future__ import annotations

import dataclasses
from typing import Any

from nanopt.config import RunConfig, TrainConfig
from nanopt.config.seq_stages import longest, stage_at, stage_tokens
from nanopt.model.flops import flops_per_token


def steps_in(cfg: TrainConfig, tokens: int) -> int:
    """The optimizer steps that train exactly `tokens` tokens from the run's start (every step has tokens, so the
    inverse of TrainConfig.tokens_before)."""
    ramp = cfg.batch_ramp
    return tokens // cfg.global_batch_tokens if ramp is None else ramp.steps_for(tokens)


def step_times(cfg: TrainConfig, seconds: float, tokens_before: int, tokens_after: int) -> tuple[float, float]:
    """(the mean step, and a full-size step at that speed) over a span of training from `tokens_before` to
    `tokens_after` tokens: the same without batch warmup; during it the steps are shorter, and the time left (a
    count of full-size steps, nanopt.train.observe.phases.projected_seconds) needs the second."""
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
    session.loader.seek(first_full)
    session.state.step, session.state.tokens = first_full, cfg.tokens_before(first_full)


def stages_note(run: RunConfig, compiled: bool) -> str:
    """', then seq_len L from step S (micro-batch M)' per stage after the base, or ''. A compiled model compiles
    each new shape once, at the stage's first step (its graphs are static: nanopt.train.parallel.wrap)."""
    again = "; torch.compile compiles the new shape there, once" if compiled else ""
    return "".join(f", then seq_len {stage.seq_len:,} from step {stage.first_step + 1:,} (micro-batch "
                   f"{stage.micro_batch_size}{again})" for stage in run.seq_stages[1:])


def run_flops_per_token(run: RunConfig) -> float:
    """The model FLOPs of a trained token over the whole run: the stages' (attention grows with seq_len), weighted
    by the tokens each trains; flops_per_token at seq_len without stages."""
    stages = run.seq_stages
    if len(stages) == 1:
        return flops_per_token(run.model, run.seq_len)
    tokens = stage_tokens(stages, run.total_steps, run.train.global_batch_tokens)
    return sum(flops_per_token(run.model, stage.seq_len) * count
               for stage, count in zip(stages, tokens, strict=True)) / max(1, sum(tokens))


def skip_to_the_longest_stage(session: Any) -> None:
    """Start `session` (not yet stepped, writing nothing) at the first step of its longest sequence-length stage,
    where the attention, so the step's time and the peak memory, are largest (a run that fits there fits
    throughout). Nothing without stages, or when the base seq_len is the longest."""
    stages = session.run.seq_stages
    first = min(longest(stages).first_step, max(0, session.total_steps - 1))
    if first == 0:
        return
    session.loader.seek(first)
    session.state.step, session.state.tokens = first, session.run.train.tokens_before(first)
    session.flops_per_token = flops_per_token(session.run.model, longest(stages).seq_len)  # for the MFU of its steps


def longest_stage_run(run: RunConfig) -> RunConfig:
    """The run as its longest sequence-length stage trains it (that seq_len, its micro-batch, no stages): what the
    memory model, find-batch's trials and the memory verdicts judge, since a run that fits there fits throughout.
    The run itself without stages (or when the base is the longest)."""
    stage = longest(run.seq_stages)
    if stage.first_step == 0:
        return run
    train = dataclasses.replace(run.train, seq_len=stage.seq_len, micro_batch_size=stage.micro_batch_size,
                                seq_len_stages=None)
    return dataclasses.replace(run, train=train)


def stage_begins(session: Any) -> bool:
    """Whether the next step the loader hands out is the first of a sequence-length stage after the base; if so,
    say so (rank 0's observer), as the start-up line announced."""
    step = session.loader.step
    stage = stage_at(session.run.seq_stages, step)
    if stage.first_step != step or step == 0:
        return False
    session.observer.note(f"step {step + 1}: seq_len {stage.seq_len:,} from here on (micro-batch "
                          f"{stage.micro_batch_size})")
    return True
