"""The resume fields of a checkpoint's meta.json, each range-checked before anything reads it.

nanopt.train.checkpoint.check_meta checks that meta.json has every field of the right JSON type; this module checks
what the values may be: counters and positions are non-negative integers that fit in 64 bits, the recovery ramp
and the metrics are what the training loop can have written, every rank's loader position and RNG state can be
restored (nanopt.rng), and the optimizer's parameter groups hold finite hyperparameters in range. A checkpoint that
fails is damaged or foreign: `nanopt train` skips it with a note and resumes from the one before, eval and export
refuse it in one line. Whether the groups and tensors match the model is nanopt.train.checkpoint.contents' to check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from nanopt.errors import CheckpointError
from nanopt.parsing import INT64_MAX, show_value
from nanopt.rng import rng_state_problem

Bad = Callable[[str], CheckpointError]

# The loader's position (nanopt.data.loaders.loader.TrainLoader.state_dict); the other keys it holds are compared with
# the live loader's by the loader itself.
_LOADER_COUNTS = ("step", "micro_step", "samples_per_step", "grad_accum", "micro_batch_size", "world_size",
                  "num_windows", "seq_len", "seed")
# Optimizer flags nanopt never sets: from a file they would turn AdamW into another optimizer (maximize: ascent;
# amsgrad: a state nanopt does not save) or fail at the first step (capturable, differentiable on the CPU).
_FLAGS_OFF = ("amsgrad", "maximize", "capturable", "differentiable")
_FLAGS = ("nesterov", "decoupled_weight_decay")
_OPTIONAL_FLAGS = ("foreach", "fused")  # true, false or null (torch decides)
MAX_NS_STEPS = 100  # Muon's Newton-Schulz iterations per step: 5 in practice; a billion would hang the step


def is_int(value: Any, low: int = 0, high: int = INT64_MAX) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past what a float holds
        return False


def check_resume_fields(meta: dict[str, Any], bad: Bad) -> None:
    """CheckpointError (from `bad`) for the first resume field out of range; `meta` passed check_meta's types."""
    _check_counters(meta, bad)
    _check_recovery(meta.get("recovery"), meta["step"], bad)
    _check_loss_scale(meta.get("loss_scale"), bad)
    _check_metrics(meta.get("metrics"), bad)
    if len(meta["ranks"]) != meta["world_size"]:
        raise bad(f"'ranks' lists {len(meta['ranks'])} rank(s) for a world_size of {meta['world_size']}")
    for index, rank in enumerate(meta["ranks"]):
        _check_loader(rank["loader"], f"ranks[{index}].loader", bad)
        problem = rng_state_problem(rank["rng"])
        if problem:
            raise bad(f"ranks[{index}].rng {problem}")
    groups = meta["optimizer_param_groups"]
    if not groups:
        raise bad("'optimizer_param_groups' is empty")
    for index, group in enumerate(groups):
        _check_group(group, f"optimizer_param_groups[{index}]", bad)


def check_weights_only_fields(meta: dict[str, Any], bad: Bad) -> None:
    """A weights-only checkpoint (`nanopt import`'s): step 0, no tokens seen, no training session's fields."""
    for key in ("step", "tokens"):
        if meta[key] != 0:
            raise bad(f"is weights-only and its '{key}' is {show_value(meta[key])}, not 0")
    for key in ("format_version", "eos_id"):
        if key in meta and not is_int(meta[key]):
            raise bad(f"'{key}' is {show_value(meta[key])}, not an integer from 0 to 2**63 - 1")
    imported = meta.get("imported_from")
    if imported is not None and not all(isinstance(v, (str, type(None))) and len(v or "") <= 4096
                                        for v in imported.values()):
        raise bad("'imported_from' holds something other than short strings")


def _check_counters(meta: dict[str, Any], bad: Bad) -> None:
    for key in ("format_version", "step", "tokens", "world_size", "skipped_steps", "eos_id"):
        if key in meta and not is_int(meta[key]):
            raise bad(f"'{key}' is {show_value(meta[key])}, not an integer from 0 to 2**63 - 1")
    if meta["world_size"] < 1:
        raise bad("'world_size' is 0")
    if not _is_loss(meta.get("best_val_loss")):
        raise bad(f"'best_val_loss' is {show_value(meta.get('best_val_loss'))}, not a loss")


def _is_loss(value: Any) -> bool:
    """A loss as the loop records it: null, a measurement that went non-finite, or a non-negative number."""
    if value is None:
        return True
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not _finite(value) or value >= 0


def _check_recovery(recovery: Any, step: int, bad: Bad) -> None:
    """The rollback counters (nanopt.train.guard.recovery): absent before automatic recovery existed. A ramp starts at
    the step rolled back to, never after the checkpoint's own."""
    if recovery is None:
        return
    if not isinstance(recovery, dict):
        raise bad(f"'recovery' is {show_value(recovery)}, not an object")
    for key in ("recoveries", "lr_ramp_start"):
        if key in recovery and not is_int(recovery[key]):
            raise bad(f"recovery.{key} is {show_value(recovery[key])}, not a non-negative integer")
    if recovery.get("lr_ramp_start", 0) > step:
        raise bad(f"recovery.lr_ramp_start {recovery['lr_ramp_start']:,} is after the checkpoint's step {step:,}")
    factor = recovery.get("lr_ramp_factor", 1.0)
    if not (is_number(factor) and 0 < factor <= 1):  # recovery_lr_factor's range, times a ramp in (0, 1]
        raise bad(f"recovery.lr_ramp_factor is {show_value(factor)}, outside (0, 1]")
    unknown = sorted(set(recovery) - {"recoveries", "lr_ramp_start", "lr_ramp_factor"})
    if unknown:  # Counters.load_state_dict would set them as counters
        raise bad(f"'recovery' holds {show_value(unknown[0])}, which nanopt does not write")


def _check_loss_scale(loss_scale: Any, bad: Bad) -> None:
    """fp16's scaler state (nanopt.train.precision.scaling): a positive finite scale, a non-negative count of good
    steps."""
    if loss_scale is None:
        return
    scale = loss_scale.get("scale")
    if not (is_number(scale) and 0 < scale <= MAX_LOSS_SCALE):
        raise bad(f"loss_scale.scale is {show_value(scale)}, outside (0, 2**64]")
    if not is_int(loss_scale.get("growth_tracker")):
        raise bad(f"loss_scale.growth_tracker is {show_value(loss_scale.get('growth_tracker'))}, not a "
                  "non-negative integer")
    unknown = sorted(set(loss_scale) - {"scale", "growth_tracker"})
    if unknown:
        raise bad(f"'loss_scale' holds {show_value(unknown[0])}, which nanopt does not write")


MAX_LOSS_SCALE = 2.0**64  # GradScaler starts at 2**16 and doubles only after 2000 good steps


def _check_metrics(metrics: Any, bad: Bad) -> None:
    if metrics is None:
        return
    for key in ("train_loss", "val_loss"):
        if not _is_loss(metrics.get(key)):
            raise bad(f"metrics.{key} is {show_value(metrics.get(key))}, not a loss")
    val_step = metrics.get("val_step")
    if val_step is not None and not is_int(val_step):
        raise bad(f"metrics.val_step is {show_value(val_step)}, not a step")


def _check_loader(loader: dict[str, Any], where: str, bad: Bad) -> None:
    for key in _LOADER_COUNTS:
        if key in loader and not is_int(loader[key]):
            raise bad(f"{where}.{key} is {show_value(loader[key])}, not an integer from 0 to 2**63 - 1")
    step, per_step = loader.get("step", 0), loader.get("samples_per_step", 1)
    if step * per_step > INT64_MAX:  # the loader's sample index, an int64 in numpy
        raise bad(f"{where}.step {step:,} x samples_per_step {per_step:,} is past 2**63 - 1 samples")
    if loader.get("micro_step", 0) >= max(1, loader.get("grad_accum", 1)):
        raise bad(f"{where}.micro_step {loader.get('micro_step')} is not below grad_accum {loader.get('grad_accum')}")


def _check_group(group: Any, where: str, bad: Bad) -> None:
    """One optimizer param group: what torch's optimizer.load_state_dict puts in place of the live group's values."""
    if not isinstance(group, dict):
        raise bad(f"{where} is {show_value(group)}, not an object")
    params = group.get("params")
    if not (isinstance(params, list) and params and all(isinstance(p, str) for p in params)):
        raise bad(f"{where}.params is not a list of parameter names")
    for key, value in group.items():
        problem = _group_value_problem(key, value)
        if problem:
            raise bad(f"{where}.{key} is {show_value(value)}: {problem}")


def _group_value_problem(key: str, value: Any) -> str | None:
    if key == "params":
        return None
    if key in ("lr", "initial_lr", "weight_decay"):
        return None if is_number(value) and value >= 0 else "not a finite number >= 0"
    if key == "eps":
        return None if is_number(value) and value > 0 else "not a finite number > 0"
    if key == "momentum":
        return None if is_number(value) and 0 <= value < 1 else "outside [0, 1)"
    if key == "betas":
        ok = isinstance(value, list) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)
        return None if ok else "not two numbers in [0, 1)"
    if key == "ns_coefficients":
        return None if isinstance(value, list) and len(value) == 3 and all(map(is_number, value)) else \
            "not three finite numbers"
    if key == "ns_steps":
        return None if is_int(value, 1, MAX_NS_STEPS) else f"not an integer from 1 to {MAX_NS_STEPS}"
    if key in _FLAGS_OFF:
        return None if value is False else "nanopt never turns it on"
    if key in _FLAGS:
        return None if isinstance(value, bool) else "not true or false"
    if key in _OPTIONAL_FLAGS:
        return None if value is None or isinstance(value, bool) else "not true, false or null"
    if key == "adjust_lr_fn":
        return None if value is None or _is_name(value) else "not a name or null"
    # A setting a newer torch added: harmless while it is a plain value.
    plain = value is None or isinstance(value, bool) or is_number(value) or _is_name(value)
    return None if plain else "not a plain setting"


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= 64
