"""The parallelism table: for 1 to 64 GPUs, the cheapest layout (DDP or FSDP2, with or without activation
checkpointing) whose predicted per-GPU peak fits, and a warning when train.json's own layout does not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanopt.config import RunConfig
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.target import Target, dividing_micro_batch, fits_in, gib, run_memory

# The GPU counts the parallelism table covers: one node (1 to 8 GPUs) and several (16 to 64); the run's own count
# (--num-gpus) is added when it is not among them.
PARALLELISM_GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)


# train.json's `parallelism` values as tables name them (nanopt.train.parallel).
SHARDING_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP2",
                  "fsdp_offload": "FSDP2 + CPU offload"}


@dataclass(frozen=True)
class Layout:
    """How the training state is spread over the GPUs: train.json's `parallelism` and `activation_checkpointing`."""

    parallelism: str
    activation_checkpointing: bool

    @property
    def name(self) -> str:
        return SHARDING_NAMES[self.parallelism] + (" + activation checkpointing" if self.activation_checkpointing
                                                    else "")

    @property
    def set_options(self) -> str:
        return (f"--set parallelism={self.parallelism} "
                f"--set activation_checkpointing={str(self.activation_checkpointing).lower()}")

    def to_dict(self) -> dict[str, Any]:
        return {"parallelism": self.parallelism, "activation_checkpointing": self.activation_checkpointing,
                "name": self.name}


# In order of preference, cheapest first. DDP keeps a whole replica per GPU and all-reduces the gradients once per
# step. Activation checkpointing recomputes each block's forward in backward: about a third more compute, a cost
# that is known in advance. FSDP2 all-gathers each block's weights in forward and again in backward and
# reduce-scatters its gradients: 1.5x DDP's traffic every step, whose cost depends on the interconnect and grows
# across nodes; so it comes after checkpointing, and with checkpointing last.
LAYOUTS = (Layout("ddp", False), Layout("ddp", True), Layout("fsdp", False), Layout("fsdp", True))

FIT_RULE = "a layout fits when its predicted per-GPU peak at the row's micro-batch is at most the GPU's memory"


def _candidate_layouts(run: RunConfig, gpus: int) -> tuple[Layout, ...]:
    # FSDP2 needs two ranks or more (on one process training wraps nothing: it is DDP's memory).
    if gpus < 2:
        return LAYOUTS[:2]
    return LAYOUTS


def parallelism(run: RunConfig | None, target: Target, precision: str, run_gpus: int) -> dict[str, Any] | None:
    """For each GPU count, the cheapest layout that fits the run's micro-batch on the target GPU, by the same memory
    model and rule as the verdict; whether train.json's own layout fits there; and a warning when it does not fit
    at the run's GPU count while another layout would. None without a run directory or on the CPU (one machine)."""
    if run is None or target.is_cpu:
        return None
    own = Layout(run.train.parallelism, run.train.activation_checkpointing)
    rows = [_layout_row(run, target, precision, gpus) for gpus in sorted({*PARALLELISM_GPU_COUNTS, run_gpus})]
    [at_run_gpus] = [r for r in rows if r["gpus"] == run_gpus]
    return {"gpu": target.key, "gpu_memory_bytes": target.memory_bytes, "rule": FIT_RULE, "run_gpus": run_gpus,
            "run_layout": own.to_dict(), "rows": rows,
            "warning": _layout_warning(at_run_gpus, own, target)}


def _layout_row(run: RunConfig, target: Target, precision: str, gpus: int) -> dict[str, Any]:
    micro_batch, note = _row_micro_batch(run, gpus)

    def memory_of(layout: Layout) -> memory_model.MemoryEstimate:
        return run_memory(run, target, precision, gpus, activation_checkpointing=layout.activation_checkpointing,
                           parallelism=layout.parallelism)

    candidates = _candidate_layouts(run, gpus)
    # The first that fits; when none does, the leanest, to say by how much it is over.
    chosen = next((layout for layout in candidates if fits_in(memory_of(layout), micro_batch, target)),
                  candidates[-1])
    memory = memory_of(chosen)
    own = run_memory(run, target, precision, gpus)  # train.json's layout, as the verdict judges it
    row = {"gpus": gpus, "micro_batch_size": micro_batch, "layout": chosen.to_dict(),
           "fits": fits_in(memory, micro_batch, target), "memory_bytes": memory.total(micro_batch),
           "headroom_bytes": target.memory_bytes - memory.total(micro_batch),
           "max_micro_batch": memory.max_micro_batch(target.memory_bytes), "note": note,
           "run_layout": {"fits": fits_in(own, micro_batch, target), "memory_bytes": own.total(micro_batch)}}
    row["text"] = _layout_text(row, chosen, target)
    return row


def _layout_text(row: dict[str, Any], layout: Layout, target: Target) -> str:
    needed, memory, micro_batch = row["memory_bytes"], target.memory_bytes, row["micro_batch_size"]
    if row["fits"]:
        return f"{layout.name}: {gib(needed)} of {gib(memory)} per GPU at micro-batch {micro_batch}"
    smaller = (f"; micro-batch {row['max_micro_batch']} would fit" if row["max_micro_batch"] >= 1 else "")
    return (f"does not fit: even {layout.name} needs {gib(needed)} per GPU at micro-batch {micro_batch}, "
            f"{gib(needed - memory)} over {gib(memory)}{smaller}")


def _row_micro_batch(run: RunConfig, gpus: int) -> tuple[int, str | None]:
    """train.json's micro-batch, or on this many GPUs the largest below it that keeps gradient accumulation whole,
    with a note when it changed or when the global batch does not split over this many GPUs at all."""
    wanted = run.train.micro_batch_size
    key = "global_batch_tokens" if run.train.batch_ramp is None else "batch_warmup_start_tokens"  # the smallest
    sequences, remainder = divmod(getattr(run.train, key), run.seq_len * gpus)
    if remainder or sequences == 0:
        return wanted, (f"{key} {getattr(run.train, key)} does not split into whole sequences "
                        f"of {run.seq_len} over {gpus} GPUs: choose a multiple of {run.seq_len * gpus}")
    size = dividing_micro_batch(run, gpus, wanted)
    if size == wanted:
        return wanted, None
    return size, (f"micro-batch {size}: train.json's {wanted} does not divide the {sequences} sequences per GPU "
                  f"of the global batch on {gpus} GPUs")


def _layout_warning(row: dict[str, Any], own: Layout, target: Target) -> str | None:
    """One line when train.json's layout does not fit at the run's GPU count while another layout does."""
    if row["run_layout"]["fits"] or not row["fits"]:
        return None
    layout = Layout(row["layout"]["parallelism"], row["layout"]["activation_checkpointing"])
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] != 1 else ''}"
    return (f"train.json's {own.name} does not fit on {gpus} of {gib(target.memory_bytes)} at "
            f"micro-batch {row['micro_batch_size']} (it needs {gib(row['run_layout']['memory_bytes'])} per GPU); "
            f"{layout.name} does ({gib(row['memory_bytes'])}): {layout.set_options}")
