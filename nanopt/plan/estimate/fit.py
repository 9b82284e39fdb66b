"""The verdict: does the run fit the device at its micro-batch, and if not, the changes that would make it fit
(a smaller micro-batch; the memory ladder's recommendation on the run's GPUs, or else on the fewest GPUs where
FSDP2 fits), cheapest first. The rungs named are the ladder's own (nanopt.plan.estimate.ladder): the verdict, the
parallelism table and the ladder never advise two different things."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nanopt.config import RunConfig
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.ladder import Rung, ladder, set_options
from nanopt.plan.estimate.target import Target, dividing_micro_batch, fits_in, gib, run_memory

# FSDP is suggested across at most this many GPUs; a run that needs more is told to shrink instead.
MAX_FSDP_GPUS = 4096


def fit(run: RunConfig | None, world: int, target: Target, precision: str, params: int,
        mfu: float) -> dict[str, Any]:
    """Whether the run fits the memory of each GPU (or of this machine), and the changes that would make it fit,
    each checked with the same memory model: `set` holds the train.json values (for --set) and `num_gpus` the GPU
    count it needs."""
    if run is None:
        return _states_fit(params, target)
    memory = target.memory_bytes
    wanted = run.train.micro_batch_size
    current = run_memory(run, target, precision, world)
    largest = current.max_micro_batch(memory)
    if fits_in(current, wanted, target):
        return {"fits": True, "remedies": [],
                "verdict": f"fits: micro-batch {wanted} needs {gib(current.total(wanted))} of {gib(memory)} "
                           f"{target.per_device}; up to about {largest} would fit"}
    if largest >= 1:
        verdict = (f"micro_batch_size {wanted} does not fit: it needs {gib(current.total(wanted))} of "
                   f"{gib(memory)} {target.per_device}; up to about {largest} fits")
    else:
        verdict = (f"does not fit in {gib(memory)} {target.per_device} even at micro-batch 1: it needs "
                   f"{gib(current.total(1))}")
    remedies = [remedy for remedy in (_smaller_micro_batch(run, world, largest),
                                      _without_health(run, world, target, precision, current),
                                      _rung(run, world, target, precision, mfu)) if remedy]
    if not remedies:
        verdict += ("; no setting nanopt has makes it fit: fewer parameters, a shorter seq_len or a device with "
                    "more memory")
    return {"fits": False, "verdict": verdict, "remedies": remedies}


def _smaller_micro_batch(run: RunConfig, world: int, largest: int) -> dict[str, Any] | None:
    if largest < 1:
        return None
    size = dividing_micro_batch(run, world, largest)
    return {"set": {"micro_batch_size": size}, "num_gpus": world,
            "text": f"micro_batch_size {size}: gradient accumulation keeps the global batch (`nanopt find-batch "
                    "--write` measures the largest that fits)"}


def _without_health(run: RunConfig, world: int, target: Target, precision: str,
                    current: memory_model.MemoryEstimate) -> dict[str, Any] | None:
    """Run health off, where its copy of the weights around a log step's update is what does not fit: the
    micro-batch then fits as it is (nothing about the training changes; its health signals go)."""
    wanted = run.train.micro_batch_size
    if not current.health_snapshot:
        return None
    without = run_memory(dataclasses.replace(run, train=dataclasses.replace(run.train, health=False)), target,
                         precision, world)
    if not fits_in(without, wanted, target):
        return None
    return {"set": {"health": False}, "num_gpus": world,
            "text": f"\"health\": false: run health copies the weights around each log step's update "
                    f"({gib(current.health_snapshot)}), the peak here; without it micro-batch {wanted} needs "
                    f"{gib(without.total(wanted))} (the per-block gradient norms and update ratios go unmeasured)"}


def _rung(run: RunConfig, world: int, target: Target, precision: str, mfu: float) -> dict[str, Any] | None:
    """The ladder's recommendation on the run's GPUs when it changes train.json's layout (a smaller micro-batch
    alone is the remedy before); when no rung fits there, on the fewest GPUs where one does (_more_gpus)."""
    if target.is_cpu:
        return None
    chosen = ladder(run, target, precision, world, mfu)["recommended"]
    if chosen is None:
        return _more_gpus(run, world, target, precision, mfu)
    own = Rung(run.train.parallelism, run.train.activation_checkpointing, run.train.optimizer)
    return None if chosen["name"] == own.name else _ladder_remedy(run, world, chosen, more_gpus=False)


def _ladder_remedy(run: RunConfig, world: int, chosen: dict[str, Any], more_gpus: bool) -> dict[str, Any]:
    """A rung of the ladder (`chosen`, a row of its table) on `world` GPUs as a remedy: the train.json values it
    changes, and the --set options of all of them."""
    own = Rung(run.train.parallelism, run.train.activation_checkpointing, run.train.optimizer)
    settings = {key: chosen[key] for key in ("parallelism", "activation_checkpointing", "optimizer")
                if chosen[key] != own.settings[key]}
    if chosen["micro_batch_size"] != run.train.micro_batch_size:
        settings["micro_batch_size"] = chosen["micro_batch_size"]
    gpus = f"{world} GPU{'s' if world != 1 else ''}"
    where = f"--num-gpus {world}, " if more_gpus else ""
    return {"set": settings, "num_gpus": world,
            "text": f"on {gpus} the memory ladder recommends {chosen['name']} ({where}{set_options(chosen)}): "
                    f"{gib(chosen['memory_bytes'])} per GPU at micro-batch {chosen['micro_batch_size']}, "
                    f"{chosen['slowdown']:.2f}x DDP's projected step"}


def _more_gpus(run: RunConfig, world: int, target: Target, precision: str, mfu: float) -> dict[str, Any] | None:
    """When no rung fits on the run's GPUs: the fewest GPUs (more than the run's, two or more) across which FSDP2's
    sharded weights, gradients and optimizer state fit micro-batch 1 with every block recomputed, and the ladder's
    recommendation there."""
    gpus = _fewest_fsdp_gpus(run, target, precision, 1, True, max(2, world + 1))
    chosen = None if gpus is None else ladder(run, target, precision, gpus, mfu)["recommended"]
    return None if chosen is None else _ladder_remedy(run, gpus, chosen, more_gpus=True)


def _fewest_fsdp_gpus(run: RunConfig, target: Target, precision: str, micro_batch: int, checkpointing: bool,
                      at_least: int) -> int | None:
    def fits(gpus: int) -> bool:
        memory = run_memory(run, target, precision, gpus, activation_checkpointing=checkpointing,
                             parallelism="fsdp")
        return fits_in(memory, micro_batch, target)

    one = run_memory(run, target, precision, 1, activation_checkpointing=checkpointing, parallelism="fsdp")
    room = target.memory_bytes - one.runtime_overhead - micro_batch * one.activations_per_sequence
    if room <= 0:
        return None  # no number of GPUs shards the activations
    gpus = max(at_least, math.ceil((one.weights + one.gradients + one.optimizer) / room))
    while gpus <= MAX_FSDP_GPUS and not fits(gpus):  # the per-GPU shares round up: at most a step or two
        gpus += 1
    return gpus if gpus <= MAX_FSDP_GPUS else None


def _states_fit(params: int, target: Target) -> dict[str, Any]:
    """A bare parameter count: only the weights, gradients and optimizer state (and the runtime) can be judged."""
    needed = memory_model.states_only(params).fixed()
    if needed <= target.memory_bytes:
        return {"fits": True, "remedies": [],
                "verdict": f"weights, gradients and optimizer state fit: {gib(needed)} of "
                           f"{gib(target.memory_bytes)} {target.per_device}; activations are not known without "
                           "a run directory"}
    verdict = (f"does not fit: weights, gradients and optimizer state alone need {gib(needed)}, more than "
               f"{gib(target.memory_bytes)} {target.per_device}")
    gpus = next((n for n in range(2, MAX_FSDP_GPUS + 1)
                 if memory_model.states_only(params, n).fixed() <= target.memory_bytes), None)
    if target.is_cpu or gpus is None:
        return {"fits": False, "remedies": [], "verdict": verdict + "; only a smaller model would fit"}
    per_gpu = memory_model.states_only(params, gpus).fixed() - memory_model.RUNTIME_OVERHEAD_BYTES
    return {"fits": False, "verdict": verdict, "remedies": [
        {"set": {"parallelism": "fsdp"}, "num_gpus": gpus,
         "text": f"FSDP across {gpus} GPUs (parallelism \"fsdp\", --num-gpus {gpus}): weights, gradients and "
                 f"optimizer state sharded to {gib(per_gpu)} per GPU, before activations"}]}
