"""The memory ladder: every rung (train.json's `parallelism` x `activation_checkpointing`) at the run's GPU count,
with its memory per GPU (the memory model's, by the one rule `fits_in`) and its projected slowdown against DDP
without checkpointing; the recommendation is the fastest rung that fits. `--compare-gpus` makes the same choice on
every GPU of the table and prices the run on each.

The slowdowns are projections from stated assumptions (below), not measurements: `nanopt preflight` with the
recommended settings measures the real step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanopt.config import RunConfig
from nanopt.hardware import GPUS
from nanopt.model import flops
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.options import DEFAULT_MFU, EstimateOptions
from nanopt.plan.estimate.target import (
    Target,
    dividing_micro_batch,
    fits_in,
    has_bf16,
    run_memory,
    run_precision,
    target_for,
)

SHARDINGS = ("ddp", "zero1", "zero2", "fsdp", "fsdp_offload")
# train.json's `parallelism` values as tables name them (nanopt.train.parallel.wrap).
SHARDING_NAMES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "fsdp": "FSDP2",
                  "fsdp_offload": "FSDP2 + CPU offload"}
CHECKPOINTING = (False, "selective", 2, True)

# Recomputation: a block's forward is about a third of its forward and backward, so recomputing every block costs
# about a third more compute, every k-th block a k-th of that. Selective checkpointing recomputes only the
# element-wise operations (norms, activation functions, RoPE): memory-bound work assumed at 5% of a step.
RECOMPUTE_ALL = 1 / 3
RECOMPUTE_SELECTIVE = 0.05
# Communication left exposed beyond DDP's gradient all-reduce (assumed, one NVLink node): ZeRO-1 broadcasts the
# updated weights after the step (an all-gather more); ZeRO-2 reduce-scatters the gradients and gathers the
# weights once (DDP's traffic, the weights in bf16); FSDP2 gathers them again in backward (1.5x DDP's traffic).
COMMUNICATION = {"ddp": 0.0, "zero1": 0.03, "zero2": 0.02, "fsdp": 0.06, "fsdp_offload": 0.06}
# torchao's 8-bit AdamW step quantizes and dequantizes both moments: memory-bound work, assumed at 2% of a step.
EIGHT_BIT_STEP = 0.02
# What train.json accepts together (nanopt.config.schema): Muon not with zero1 or fsdp_offload, 8-bit AdamW not with
# zero1 (under FSDP2 each rank holds its rows' 8-bit moments: nanopt.train.optim.lowbit).
SHARDINGS_FOR = {"adamw": SHARDINGS, "adamw8bit": ("ddp", "zero2", "fsdp", "fsdp_offload"),
                 "muon": ("ddp", "zero2", "fsdp")}
# CPU offload, not overlapped: each rank's fp32 weight shards cross PCIe to the GPU in forward and again in
# backward, every micro-step; its gradient shards come back once a step; its AdamW step runs on the CPU (reading
# weights, gradients and both moments, writing weights and moments: 28 bytes per parameter, 16 with 8-bit moments)
# at the rate of torch's foreach AdamW on a CPU, well below the host's memory bandwidth.
PCIE_BYTES_PER_S = 25e9  # PCIe 4.0 x16, effective
HOST_STEP_BYTES_PER_S = 2e9
OFFLOAD_WEIGHT_BYTES_PER_MICRO_STEP = 4 + 4
OFFLOAD_GRADIENT_BYTES = 4
OFFLOAD_HOST_BYTES_PER_PARAM = {"adamw": 28, "adamw8bit": 16}

ASSUMPTIONS = ("slowdown against DDP without checkpointing, projected: recomputing every block +33% compute, "
               "every k-th block +33%/k, selective +5%; 8-bit AdamW +2%; exposed communication ZeRO-1 +3%, "
               "ZeRO-2 +2%, FSDP2 +6%; CPU offload adds its PCIe copies (weights every micro-step) at 25 GB/s and a "
               "CPU AdamW step at 2 GB/s; a smaller micro-batch's lower utilization is not counted; `nanopt "
               "preflight` measures the real step")


@dataclass(frozen=True)
class Rung:
    parallelism: str
    checkpointing: bool | int | str
    optimizer: str = "adamw"

    @property
    def name(self) -> str:
        checkpointing = {False: "", True: " + ckpt all", "selective": " + ckpt selective"}.get(
            self.checkpointing, f" + ckpt every {self.checkpointing}")
        return SHARDING_NAMES[self.parallelism] + (" + 8-bit AdamW" if self.optimizer == "adamw8bit" else "") + \
            checkpointing

    @property
    def settings(self) -> dict[str, Any]:
        return {"parallelism": self.parallelism, "activation_checkpointing": self.checkpointing,
                "optimizer": self.optimizer}

    def recompute(self) -> float:
        if self.checkpointing == "selective":
            return RECOMPUTE_SELECTIVE
        every = {False: 0, True: 1}.get(self.checkpointing, self.checkpointing)
        return RECOMPUTE_ALL / every if every else 0.0

    def slowdown(self) -> float:
        """Recomputation, communication and the 8-bit step, before CPU offload's own cost (see `_offload`)."""
        eight_bit = EIGHT_BIT_STEP if self.optimizer == "adamw8bit" else 0.0
        return (1 + self.recompute()) * (1 + COMMUNICATION[self.parallelism]) + eight_bit


def rungs(gpus: int, optimizer: str = "adamw") -> list[Rung]:
    """Every rung on this many GPUs that train.json accepts with the run's optimizer (an AdamW run may also
    switch to 8-bit AdamW); one process shards nothing, so one GPU has DDP's rungs only."""
    optimizers = ("adamw", "adamw8bit") if optimizer in ("adamw", "adamw8bit") else (optimizer,)
    return [Rung(parallelism, checkpointing, name) for name in optimizers for parallelism in SHARDINGS_FOR[name]
            if gpus > 1 or parallelism == "ddp" for checkpointing in CHECKPOINTING]


def ladder(run: RunConfig | None, target: Target, precision: str, gpus: int, mfu: float) -> dict[str, Any] | None:
    """Each rung on `gpus` of the target GPU, fastest first, and the recommended one (None: nothing fits). None
    without a run directory or on the CPU."""
    if run is None or target.is_cpu:
        return None
    step_s = run.train.global_batch_tokens * flops.flops_per_token(run.model, run.seq_len) / (
        gpus * target.peak_flops * mfu)
    rows = sorted((_row(run, target, precision, gpus, rung, step_s) for rung in rungs(gpus, run.train.optimizer)),
                  key=lambda row: row["slowdown"])  # stable: at equal slowdown, the order of `rungs`
    recommended = next((row for row in rows if row["fits"]), None)
    return {"gpu": target.key, "gpus": gpus, "gpu_memory_bytes": target.memory_bytes, "precision": precision,
            "rows": rows, "recommended": recommended, "assumptions": ASSUMPTIONS}


def _row(run: RunConfig, target: Target, precision: str, gpus: int, rung: Rung, step_s: float) -> dict[str, Any]:
    memory = run_memory(run, target, precision, gpus, activation_checkpointing=rung.checkpointing,
                        parallelism=rung.parallelism, optimizer=rung.optimizer)
    largest = memory.max_micro_batch(target.memory_bytes)
    micro_batch = dividing_micro_batch(run, gpus, min(max(largest, 1), run.train.micro_batch_size))
    fits = largest >= 1 and fits_in(memory, micro_batch, target)
    slowdown = rung.slowdown() + _offload(run, rung, gpus, step_s)
    return {**rung.settings, "name": rung.name, "fits": fits, "micro_batch_size": micro_batch,
            "max_micro_batch": largest, "memory_bytes": memory.total(micro_batch), "host_bytes": memory.host,
            "slowdown": round(slowdown, 3)}


def leanest(ladder: dict[str, Any]) -> dict[str, Any]:
    """The rung that needs the least memory per GPU: what to show, with by how much it is over, when none fits."""
    return min(ladder["rows"], key=lambda row: row["memory_bytes"])


def set_options(settings: dict[str, Any]) -> str:
    """A rung as `--set` options (what train, find-batch and preflight take)."""
    checkpointing = settings["activation_checkpointing"]
    value = str(checkpointing).lower() if isinstance(checkpointing, bool) else checkpointing
    return (f"--set parallelism={settings['parallelism']} --set activation_checkpointing={value}"
            f" --set optimizer={settings['optimizer']}")


def _offload(run: RunConfig, rung: Rung, gpus: int, step_s: float) -> float:
    """CPU offload's copies and host optimizer step per step, as a fraction of the step's compute."""
    if rung.parallelism not in memory_model.OFFLOADED:
        return 0.0
    per_rank = flops.count_params(run.model).total / gpus
    micro_steps = max(1, run.train.global_batch_tokens // (run.tokens_per_micro_batch * gpus))
    copied = per_rank * (micro_steps * OFFLOAD_WEIGHT_BYTES_PER_MICRO_STEP + OFFLOAD_GRADIENT_BYTES)
    host_step = per_rank * OFFLOAD_HOST_BYTES_PER_PARAM[rung.optimizer] / HOST_STEP_BYTES_PER_S
    seconds = copied / PCIE_BYTES_PER_S + host_step
    return seconds / step_s


def compare_gpus(run: RunConfig, opts: EstimateOptions, train_flops: float, train_tokens: int) -> dict[str, Any]:
    """On every GPU of the table, `opts.num_gpus` of them: the rung the ladder recommends there, and the run's time,
    cost and dollars per million tokens with it (the MFU assumed, --mfu or the default, on every card alike), the
    cheapest per token first; cards on which nothing fits last."""
    mfu = opts.mfu or DEFAULT_MFU
    rows = []
    for key in GPUS:
        precision = run_precision(run, False, has_bf16(key))
        target = target_for(replace(opts, gpu=key, peak_tflops=None, gpu_memory=None), precision)
        chosen = ladder(run, target, precision, opts.num_gpus, mfu)["recommended"]
        row: dict[str, Any] = {"gpu": key, "name": target.name, "num_gpus": opts.num_gpus, "precision": precision,
                               "fits": chosen is not None, "rung": chosen}
        if chosen is not None:
            seconds = flops.train_seconds(train_flops, opts.num_gpus, target.peak_flops, mfu) * chosen["slowdown"]
            cost = seconds / 3600 * opts.num_gpus * target.usd_per_hour
            row.update(train_seconds=seconds, cost_usd=cost, usd_per_million_tokens=cost / (train_tokens / 1e6))
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], r.get("usd_per_million_tokens") or 0.0, r.get("train_seconds") or 0.0))
    return {"num_gpus": opts.num_gpus, "mfu": mfu, "rows": rows, "assumptions": ASSUMPTIONS}
