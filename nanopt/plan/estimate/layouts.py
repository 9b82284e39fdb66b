"""The parallelism table: for 1 to 64 GPUs, the memory ladder's recommendation there (nanopt.plan.estimate.ladder:
the fastest rung whose predicted per-GPU peak fits), whether train.json's own layout fits, and a warning when it
does not fit at the run's GPU count while a rung does. The ladder is the one home of this advice: the table, the
warning and the verdict's remedies all name its choice."""

from __future__ import annotations

from typing import Any

from nanopt.config import RunConfig
from nanopt.plan.estimate.ladder import Rung, ladder, leanest, set_options
from nanopt.plan.estimate.target import Target, dividing_micro_batch, fits_in, gib, run_memory

# The GPU counts the parallelism table covers: one node (1 to 8 GPUs) and several (16 to 64); the run's own count
# (--num-gpus) is added when it is not among them.
PARALLELISM_GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)

FIT_RULE = "a layout fits when its predicted per-GPU peak at the row's micro-batch is at most the GPU's memory"

LAYOUT_KEYS = ("parallelism", "activation_checkpointing", "optimizer", "name")


def own_rung(run: RunConfig) -> Rung:
    """train.json's own layout, as the ladder names it."""
    return Rung(run.train.parallelism, run.train.activation_checkpointing, run.train.optimizer)


def parallelism(run: RunConfig | None, target: Target, precision: str, run_gpus: int,
                mfu: float) -> dict[str, Any] | None:
    """For each GPU count, the ladder's recommendation (or, when no rung fits, the leanest, to say by how much it is
    over), by the same memory model and rule as the verdict; whether train.json's own layout fits there; and a
    warning when it does not fit at the run's GPU count while a rung does. None without a run directory or on the
    CPU (one machine)."""
    if run is None or target.is_cpu:
        return None
    own = own_rung(run)
    rows = [_layout_row(run, target, precision, gpus, mfu) for gpus in sorted({*PARALLELISM_GPU_COUNTS, run_gpus})]
    [at_run_gpus] = [r for r in rows if r["gpus"] == run_gpus]
    return {"gpu": target.key, "gpu_memory_bytes": target.memory_bytes, "rule": FIT_RULE, "run_gpus": run_gpus,
            "run_layout": {**own.settings, "name": own.name}, "rows": rows,
            "warning": _layout_warning(at_run_gpus, own, target)}


def _layout_row(run: RunConfig, target: Target, precision: str, gpus: int, mfu: float) -> dict[str, Any]:
    micro_batch, note = _row_micro_batch(run, gpus)
    splits = _batch_splits(run, gpus)
    rungs = ladder(run, target, precision, gpus, mfu)
    chosen = rungs["recommended"] or leanest(rungs)
    own = run_memory(run, target, precision, gpus)  # train.json's layout, as the verdict judges it
    row = {"gpus": gpus, "micro_batch_size": chosen["micro_batch_size"],
           "layout": {key: chosen[key] for key in LAYOUT_KEYS}, "fits": chosen["fits"],
           "memory_bytes": chosen["memory_bytes"], "headroom_bytes": target.memory_bytes - chosen["memory_bytes"],
           "max_micro_batch": chosen["max_micro_batch"], "slowdown": chosen["slowdown"], "note": note,
           # train.json runs here only if its global batch splits over these GPUs, whatever the memory says
           "run_layout": {"micro_batch_size": micro_batch, "fits": splits and fits_in(own, micro_batch, target),
                          "batch_splits": splits, "memory_bytes": own.total(micro_batch)}}
    row["text"] = _layout_text(row, target)
    return row


def _layout_text(row: dict[str, Any], target: Target) -> str:
    needed, memory, micro_batch = row["memory_bytes"], target.memory_bytes, row["micro_batch_size"]
    name = row["layout"]["name"]
    if row["fits"]:
        return f"{name}: {gib(needed)} of {gib(memory)} per GPU at micro-batch {micro_batch}"
    return (f"does not fit: even {name} needs {gib(needed)} per GPU at micro-batch {micro_batch}, "
            f"{gib(needed - memory)} over {gib(memory)}")


def _smallest_batch_key(run: RunConfig) -> str:
    return "global_batch_tokens" if run.train.batch_ramp is None else "batch_warmup_start_tokens"


def _batch_splits(run: RunConfig, gpus: int) -> bool:
    """Whether the global batch (its smallest, with a batch warmup) is whole sequences on each of `gpus`."""
    sequences, remainder = divmod(getattr(run.train, _smallest_batch_key(run)), run.seq_len * gpus)
    return remainder == 0 and sequences > 0


def _row_micro_batch(run: RunConfig, gpus: int) -> tuple[int, str | None]:
    """train.json's micro-batch, or on this many GPUs the largest below it that keeps gradient accumulation whole,
    with a note when it changed or when the global batch does not split over this many GPUs at all."""
    wanted = run.train.micro_batch_size
    key = _smallest_batch_key(run)
    sequences = getattr(run.train, key) // (run.seq_len * gpus)
    if not _batch_splits(run, gpus):
        return wanted, (f"{key} {getattr(run.train, key)} does not split into whole sequences "
                        f"of {run.seq_len} over {gpus} GPUs: choose a multiple of {run.seq_len * gpus}")
    size = dividing_micro_batch(run, gpus, wanted)
    if size == wanted:
        return wanted, None
    return size, (f"micro-batch {size}: train.json's {wanted} does not divide the {sequences} sequences per GPU "
                  f"of the global batch on {gpus} GPUs")


def _layout_warning(row: dict[str, Any], own: Rung, target: Target) -> str | None:
    """One line when train.json's layout does not fit at the run's GPU count while a rung of the ladder does: the
    ladder's recommendation, as the ladder's table gives it."""
    if row["run_layout"]["fits"] or not row["fits"] or not row["run_layout"]["batch_splits"]:
        return None  # a batch that does not split is the note's (and the verdict's) to say, not memory's
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] != 1 else ''}"
    return (f"train.json's {own.name} does not fit on {gpus} of {gib(target.memory_bytes)} at "
            f"micro-batch {row['run_layout']['micro_batch_size']} (it needs "
            f"{gib(row['run_layout']['memory_bytes'])} per GPU); the memory ladder recommends {row['layout']['name']} "
            f"({gib(row['memory_bytes'])} at micro-batch {row['micro_batch_size']}): {set_options(row['layout'])}")
