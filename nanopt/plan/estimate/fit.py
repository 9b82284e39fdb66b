"""The verdict: does the run fit the device at its micro-batch, and if not, the changes that would make it fit
(a smaller micro-batch, activation checkpointing, FSDP2 over enough GPUs), cheapest first."""

from __future__ import annotations

import math
from typing import Any

from nanopt.config import RunConfig
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.target import Target, dividing_micro_batch, fits_in, gib, run_memory

# FSDP is suggested across at most this many GPUs; a run that needs more is told to shrink instead.
MAX_FSDP_GPUS = 4096


def fit(run: RunConfig | None, world: int, target: Target, precision: str, params: int) -> dict[str, Any]:
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
                                      _checkpointing(run, world, target, precision, current, largest),
                                      _fsdp(run, world, target, precision, largest)) if remedy]
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


def _checkpointing(run: RunConfig, world: int, target: Target, precision: str,
                   current: memory_model.MemoryEstimate, largest_now: int) -> dict[str, Any] | None:
    """Activation checkpointing, when it is off and turning it on fits a larger micro-batch than now."""
    if run.train.activation_checkpointing:
        return None
    checkpointed = run_memory(run, target, precision, world, activation_checkpointing=True)
    largest = checkpointed.max_micro_batch(target.memory_bytes)
    if largest <= largest_now:
        return None
    size = dividing_micro_batch(run, world, min(largest, run.train.micro_batch_size))
    settings: dict[str, Any] = {"activation_checkpointing": True}
    if size != run.train.micro_batch_size:
        settings["micro_batch_size"] = size
    return {"set": settings, "num_gpus": world,
            "text": f"activation_checkpointing true: activations per sequence "
                    f"{gib(current.activations_per_sequence)} -> {gib(checkpointed.activations_per_sequence)} "
                    f"(recomputed in backward, about a third more compute); micro-batch {size} fits"}


def _fsdp(run: RunConfig, world: int, target: Target, precision: str, largest_now: int) -> dict[str, Any] | None:
    """The fewest GPUs (two or more; from the run's own count for a DDP run, more than it for an FSDP one) across
    which FSDP's sharded weights, gradients and optimizer state fit the run's micro-batch, or else, when not even
    micro-batch 1 fits now, micro-batch 1; with activation checkpointing when the activations alone are too large."""
    if target.is_cpu:
        return None
    at_least = max(2, world if run.train.parallelism == "ddp" else world + 1)
    sizes = (run.train.micro_batch_size,) if largest_now >= 1 else (run.train.micro_batch_size, 1)
    for checkpointing in dict.fromkeys((run.train.activation_checkpointing, True)):
        for size in dict.fromkeys(sizes):
            gpus = _fewest_fsdp_gpus(run, target, precision, size, checkpointing, at_least)
            if gpus is not None:
                return _fsdp_remedy(run, target, precision, gpus, checkpointing)
    return None


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


def _fsdp_remedy(run: RunConfig, target: Target, precision: str, gpus: int, checkpointing: bool) -> dict[str, Any]:
    sharded = run_memory(run, target, precision, gpus, activation_checkpointing=checkpointing, parallelism="fsdp")
    size = dividing_micro_batch(run, gpus, min(sharded.max_micro_batch(target.memory_bytes),
                                                run.train.micro_batch_size))
    settings: dict[str, Any] = {"parallelism": "fsdp"}
    if checkpointing and not run.train.activation_checkpointing:
        settings["activation_checkpointing"] = True
    if size != run.train.micro_batch_size:
        settings["micro_batch_size"] = size
    with_checkpointing = ", with activation checkpointing" if "activation_checkpointing" in settings else ""
    return {"set": settings, "num_gpus": gpus,
            "text": f"FSDP across {gpus} GPUs (parallelism \"fsdp\", --num-gpus {gpus}{with_checkpointing}): "
                    f"weights, gradients and optimizer state sharded to "
                    f"{gib(sharded.weights + sharded.gradients + sharded.optimizer)} per GPU; micro-batch {size} "
                    "fits"}


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
