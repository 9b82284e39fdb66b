"""How far the memory model (nanopt.model.memory) is from what the trials measured."""

from __future__ import annotations

import dataclasses
from typing import Any

from nanopt.config import RunConfig
from nanopt.model.memory import estimate_memory
from nanopt.plan.find_batch.search import Trial, usable_micro_batches


def calibrate(run: RunConfig, world: int, facts: dict[str, Any], trials: dict[int, Trial], usable: int | None,
              max_fit: int, capped: bool) -> dict[str, Any]:
    """How far nanopt.model.memory.estimate_memory is from what the trials measured; fills each trial's prediction."""
    if facts.get("precision") is None:
        return {"predicted_peak_bytes": None, "measured_peak_bytes": None, "peak_error": None,
                "predicted_max_micro_batch": None, "max_micro_batch_error": None, "note": "nothing was measured"}
    on_cpu = facts.get("device") != "cuda"
    model = _memory_model(run, world, facts["precision"], bool(facts["compiled"]),
                          facts.get("baseline_bytes") if on_cpu else None)
    for trial in trials.values():
        trial.predicted_peak_bytes = model.total(trial.micro_batch_size)
        if trial.peak_memory_bytes and not trial.peak_is_lower_bound:
            trial.peak_error = trial.predicted_peak_bytes / trial.peak_memory_bytes - 1
    point = _calibration_point(trials, max_fit)
    predicted_max = model.max_micro_batch(usable) if usable is not None else None
    # The search tries only sizes that divide the global batch, so its answer is compared with the largest such size
    # the model says fits (GPT-2 small on an H100: 189 predicted, 128 found, 256 failed: the model picks 128 too).
    predicted_usable = _largest_usable(run, world, predicted_max)
    slope = _measured_bytes_per_sequence(trials)
    note = ("CPU: peaks are the trial process's resident memory, Python and torch included; the model's runtime "
            "overhead is replaced by that measured baseline" if on_cpu else
            "GPU: peaks are the allocator's peak reserved bytes plus the CUDA context")
    return {
        "predicted_peak_bytes": point.predicted_peak_bytes if point else None,
        "measured_peak_bytes": point.peak_memory_bytes if point else None,
        "peak_error": point.peak_error if point else None,
        "at_micro_batch": point.micro_batch_size if point else None,
        "predicted_max_micro_batch": predicted_max,
        "predicted_usable_micro_batch": predicted_usable,
        "max_micro_batch_error": predicted_usable / max_fit - 1
        if predicted_usable is not None and max_fit and not capped else None,
        "predicted_bytes_per_sequence": model.activations_per_sequence,
        "measured_bytes_per_sequence": slope,
        "note": note + ("; max_micro_batch_error is not defined when every size up to --max fits" if capped else ""),
    }


def predict_micro_batch(run: RunConfig, world: int, precision: str | None, compiled: bool, usable: int | None,
                        baseline_bytes: int | None = None) -> int | None:
    """The largest micro-batch the memory model says fits in `usable` bytes (None without a limit): where the search
    starts unless --start says otherwise. `baseline_bytes`: on the CPU, what a process holds before its first
    tensor (Python and torch), in place of the model's CUDA context. None without a limit or a precision."""
    if usable is None or precision is None:
        return None
    return _memory_model(run, world, precision, compiled, baseline_bytes).max_micro_batch(usable)


def _memory_model(run: RunConfig, world: int, precision: str, compiled: bool, baseline_bytes: int | None) -> Any:
    model = estimate_memory(run.model, run.seq_len, precision=precision, compiled=compiled,
                            activation_checkpointing=run.train.activation_checkpointing,
                            parallelism=run.train.parallelism, world_size=world, optimizer=run.train.optimizer,
                            # a trial steps as the run will (search.trial_run): gradients held where it accumulates
                            step_sequences=run.sequences_per_rank(world), health=run.train.health,
                            weight_copies=run.train.bf16_weight_copies)
    if baseline_bytes:
        # The model's runtime overhead stands for a CUDA context; a CPU process has Python and torch instead.
        model = dataclasses.replace(model, runtime_overhead=int(baseline_bytes))
    return model


def _largest_usable(run: RunConfig, world: int, predicted_max: int | None) -> int | None:
    """The largest micro-batch up to `predicted_max` that divides the global batch (search.usable_micro_batches),
    0 when not even 1 fits; None without a prediction."""
    if predicted_max is None:
        return None
    if predicted_max < 1:
        return 0
    return usable_micro_batches(run.train, run.seq_len, world, predicted_max)[-1]


def _calibration_point(trials: dict[int, Trial], max_fit: int) -> Trial | None:
    """The largest size that fit (the most relevant), else the smallest that was measured."""
    if max_fit and trials[max_fit].peak_memory_bytes:
        return trials[max_fit]
    measured = [t for t in trials.values() if t.peak_memory_bytes and not t.peak_is_lower_bound]
    return min(measured, key=lambda t: t.micro_batch_size, default=None)


def _measured_bytes_per_sequence(trials: dict[int, Trial]) -> int | None:
    """Activation memory per sequence: the least-squares slope of peak against size over the sizes that fit
    (two neighbouring sizes alone differ by little more than the measurement's noise)."""
    points = [(t.micro_batch_size, t.peak_memory_bytes) for t in trials.values() if t.fits and t.peak_memory_bytes]
    if len(points) < 2:
        return None
    mean_b = sum(b for b, _ in points) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    return int(sum((b - mean_b) * (p - mean_p) for b, p in points) / spread)


