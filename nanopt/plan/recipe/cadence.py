"""The batch a plan trains with and how often it warms up, logs, evaluates and checkpoints, from the rule's batch,
the memory model's largest micro-batch and the predicted step time.

- Global batch: the rule's B_opt in whole sequences per GPU, moved by at most BATCH_TOLERANCE (or the rounding to
  whole sequences, when that is more) so that the largest micro-batch that fits divides it.
- Warmup: WARMUP_SHARE of the steps, at least MIN_WARMUP_STEPS and at most DeepSeek LLM's 2000.
- Evaluation: EVAL_SHARE of the steps' time at most, spread over about TARGET_EVALS evaluations of a fixed slice
  of the val split (at most MAX_EVAL_TOKENS, at least one sequence), never more than MAX_EVALS in a run.
- Checkpoints: a kill loses at most LOST_SHARE of the steps' time or MAX_LOST_S, whichever is less, unless saving
  that often would cost more than CHECKPOINT_SHARE of it: then the save cost decides, and the plan says what a
  kill loses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BATCH_TOLERANCE = 0.05
WARMUP_SHARE, MIN_WARMUP_STEPS, MAX_WARMUP_STEPS = 0.05, 10, 2000
EVAL_SHARE, TARGET_EVALS, MAX_EVALS, MAX_EVAL_TOKENS = 0.02, 10, 100, 1 << 20
LOST_SHARE, MAX_LOST_S, CHECKPOINT_SHARE = 0.01, 1800.0, 0.01
KEEP_CHECKPOINTS = 2
LOG_INTERVAL, LOGS_AT_LEAST = 10, 20


@dataclass(frozen=True)
class Cadence:
    warmup_steps: int
    log_interval: int
    eval_interval: int
    eval_tokens: int
    checkpoint_interval: int
    lost_s: float  # the most a kill loses: one checkpoint interval of steps
    lost_limit_s: float  # what it was to lose at most: min(LOST_SHARE of the steps' time, MAX_LOST_S)


def batch_for(batch_tokens: float, seq_len: int, gpus: int, max_micro_batch: int) -> tuple[int, int]:
    """(micro-batch, sequences per GPU per step): the largest micro-batch up to `max_micro_batch` that divides a
    whole number of sequences within the tolerance of the rule's batch."""
    target = max(1.0, batch_tokens / (seq_len * gpus))
    tolerance = max(BATCH_TOLERANCE, abs(round(target) - target) / target)
    for micro in range(max(1, min(max_micro_batch, round(target))), 0, -1):
        sequences = micro * max(1, round(target / micro))
        if abs(sequences - target) <= tolerance * target + 1e-9:
            return micro, sequences
    return 1, max(1, round(target))  # micro-batch 1 always meets the rounding's own tolerance; for safety


def warmup_for(steps: int) -> int:
    return min(MAX_WARMUP_STEPS, max(MIN_WARMUP_STEPS, round(WARMUP_SHARE * steps)), max(1, steps - 1))


def log_interval_for(steps: int) -> int:
    return max(1, min(LOG_INTERVAL, steps // LOGS_AT_LEAST))


def eval_tokens_for(train_tokens: int, seq_len: int, val_tokens: int) -> int:
    """A slice that TARGET_EVALS + 1 evaluations (the last step's included) read in EVAL_SHARE of the steps' time:
    forward only, each evaluated token costs a third of a trained one."""
    share = 3 * EVAL_SHARE / (1 - EVAL_SHARE) * train_tokens / (TARGET_EVALS + 1)
    most = min(MAX_EVAL_TOKENS, val_tokens - 1)
    return max(seq_len, min(most, int(share)) // seq_len * seq_len)


def eval_interval_for(steps: int, step_s: float, eval_s: float) -> int:
    """The shortest interval whose evaluations stay under EVAL_SHARE of the time of steps and evaluations, and
    number at most MAX_EVALS."""
    return _shortest(steps, step_s, eval_s, EVAL_SHARE, max(1, math.ceil(steps / MAX_EVALS)))


def lost_limit(steps: int, step_s: float) -> float:
    return min(LOST_SHARE * steps * step_s, MAX_LOST_S)


def checkpoint_interval_for(steps: int, step_s: float, checkpoint_s: float) -> int:
    """The interval after which a kill loses at most lost_limit, unless its saves would cost more than
    CHECKPOINT_SHARE of the time: then the shortest whose saves do not."""
    by_loss = max(1, math.floor(lost_limit(steps, step_s) / step_s))
    return _shortest(steps, step_s, checkpoint_s, CHECKPOINT_SHARE, by_loss)


def _shortest(steps: int, step_s: float, each_s: float, share: float, start: int) -> int:
    """The shortest interval from `start` whose occasions (one at each multiple, and one at the last step, as
    training has them) take at most `share` of the time of the steps and the occasions; the whole run if none."""
    for interval in range(min(start, steps), steps + 1):
        occasions = steps // interval + (1 if steps % interval else 0)
        if occasions * each_s <= share * (steps * step_s + occasions * each_s):
            return interval
    return steps


def cadence_for(steps: int, step_s: float, eval_tokens: int, eval_s: float, checkpoint_s: float) -> Cadence:
    interval = checkpoint_interval_for(steps, step_s, checkpoint_s)
    return Cadence(warmup_steps=warmup_for(steps), log_interval=log_interval_for(steps),
                   eval_interval=eval_interval_for(steps, step_s, eval_s), eval_tokens=eval_tokens,
                   checkpoint_interval=interval, lost_s=interval * step_s, lost_limit_s=lost_limit(steps, step_s))
