"""The micro-batch a resumed run uses when the world size it resumes on cannot take train.json's.

The global batch is fixed for the life of a run (it is the optimization); the micro-batch is only how each rank's
share is cut into forward passes. A run resumed on more ranks can find its micro-batch x seq_len x world size past
or not dividing the global batch. Then the session takes the largest micro-batch up to the configured one that
divides it (never larger: it fits in memory where the configured one did) and says so; train.json is unchanged.
A fresh run keeps the error that says which numbers work: there the person chooses, before any step is spent.
"""

from __future__ import annotations

import dataclasses

from nanopt.config import RunConfig
from nanopt.config.seq_stages import whole_in_every_stage
from nanopt.errors import ConfigError
from nanopt.rundir import STEP_NAME, RunDir


def micro_batch_for_world(run: RunConfig, world_size: int, resume: str) -> tuple[RunConfig, str | None]:
    """(the run this session trains, a note when its micro-batch was lowered for `world_size`). ConfigError as
    RunConfig.grad_accum_steps raises it for a fresh run, or when no micro-batch divides the global batch."""
    try:
        run.grad_accum_steps(world_size)
        return run, None
    except ConfigError:
        # the smallest batch of the run: under batch warmup its first, which every later one is a multiple of
        smallest = run.train.batch_warmup_start_tokens or run.train.global_batch_tokens
        sequences, remainder = divmod(smallest, run.seq_len * world_size)
        if resume == "none" or remainder or sequences < 1 or not _has_checkpoints(run):
            raise
    configured = run.train.micro_batch_size
    # Under sequence-length stages a micro-batch must also be whole sequences of every stage's length.
    lengths = [stage.seq_len for stage in run.seq_stages]
    sizes = [size for size in range(1, min(configured, sequences) + 1)
             if sequences % size == 0 and whole_in_every_stage(size, run.seq_len, lengths)]
    if not sizes:
        raise ConfigError(f"no micro-batch up to {configured} divides the global batch of {smallest:,} tokens on "
                          f"{world_size} rank(s) into whole sequences of every seq_len stage {lengths}",
                          "resume on the world size the run was started on")
    fitted = max(sizes)
    batch = "global batch" if run.train.batch_ramp is None else "batch warmup's first batch"
    note = (f"micro_batch_size {configured} does not divide the {batch} of {smallest:,} "
            f"tokens on {world_size} rank(s): this session uses {fitted} (accumulation {sequences // fitted}), the "
            "largest that does; train.json is unchanged")
    return dataclasses.replace(run, train=dataclasses.replace(run.train, micro_batch_size=fitted)), note


def _has_checkpoints(run: RunConfig) -> bool:
    """Whether the run directory holds a checkpoint a resume could continue from (its step directories)."""
    folder = RunDir(run.run_dir).checkpoints
    try:
        return any(STEP_NAME.fullmatch(entry.name) for entry in folder.iterdir())
    except OSError:  # none yet, or unreadable: resuming would say why
        return False
