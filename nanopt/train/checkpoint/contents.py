"""A checkpoint's stored tensors and optimizer groups against its own config snapshot, before anything is loaded.

The snapshot is validated as model.json is (nanopt.config.model_config_from_snapshot), the model it describes is
built on the meta device (nanopt.model.layout), and the stored side is read from file headers only: the safetensors
headers of a one-process checkpoint (nanopt.safetensors_header, which checks each file's own integrity), the shard
index of a sharded one. Every weight must be there with the model's shape and dtype and nothing else; optimizer
state only for the model's parameters, shaped like them; the optimizer's parameter groups exactly those
build_optimizer makes; the tied names and the EOS id the model's. Only then does eval, export or train allocate
anything, so a snapshot can never ask for memory the files do not back (a 1.7 GB model from a 270 KB checkpoint),
and a damaged or crafted checkpoint is skipped or refused in one line instead of failing in torch.

The optimizer state is held to what its optimizer keeps for each parameter: every part present (a state with a
part missing would resume as another run without a word), each of the shape and dtype that optimizer gives it
(8-bit AdamW's codes, scales and code book included: a disagreeing part fails inside the compiled step). Values
are seen only once read: `state_values_problem` checks them as resume loads them, before a step uses them.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from nanopt.config import ModelConfig, model_config_from_snapshot
from nanopt.errors import CheckpointError, ConfigError
from nanopt.model.layout import TensorSpec, meta_model, mismatch, parameter_specs, tensor_specs, tied_aliases
from nanopt.safetensors_header import read_header
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.meta_fields import Bad
from nanopt.train.optim import lowbit

# Optimizer state shaped like its parameter (AdamW's moments, Muon's momentum); "step" is a scalar. Other names
# (a newer torch's) are left to the optimizer, which reads only the names it knows.
_LIKE_PARAMETER = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
OPTIMIZERS = ("adamw", "muon", "adamw8bit")
STEP = TensorSpec((), "float32")  # torch's and torchao's step count
_EIGHT_BIT = {f"{moment}_{part}" for moment in lowbit.SIGNED for part in lowbit.PARTS}
# Never negative: a second moment is a mean of squares (its square root would be NaN), 8-bit AdamW's scales are
# absolute maxima, and the unsigned code book it dequantizes second moments with runs from 0 to 1.
_NON_NEGATIVE = {"exp_avg_sq", "max_exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale", "exp_avg_sq_qmap"}


class DamagedState(CheckpointError):
    """Optimizer state whose values, seen as they are loaded, no optimizer could have written."""


def check_contents(path: Path, meta: dict[str, Any], bad: Bad) -> ModelConfig:
    """CheckpointError unless the checkpoint at `path` holds exactly what its snapshot's model and optimizer would
    (see the module docstring); returns the snapshot's model config. `meta` passed check_meta."""
    model = snapshot_model(meta, bad)
    optimizer = meta["config"]["train"].get("optimizer", "adamw")  # checkpoints older than the key: AdamW
    if optimizer not in OPTIMIZERS:
        raise bad(f"config.train.optimizer is {str(optimizer)[:40]!r}, not one of {OPTIMIZERS}")
    if meta.get("eos_id", 0) >= model.vocab_size:
        raise bad(f"'eos_id' {meta['eos_id']} is past the model's vocabulary of {model.vocab_size}")
    weights, state = _stored(path, meta)
    if len(weights) < model.num_hidden_layers:  # decided before the meta-device model is built (a second or more)
        raise _mismatch(path, f"its config has {model.num_hidden_layers:,} layers, {len(weights):,} weight "
                              "tensors are stored")
    aliases = meta.get("tied", {})
    own_aliases = tied_aliases(meta_model(model))
    if any(alias not in own_aliases or own_aliases[alias] != source for alias, source in aliases.items()):
        raise bad(f"'tied' is {str(aliases)[:60]}, the model ties {own_aliases}")
    problem = mismatch({k: v for k, v in tensor_specs(model).items() if k not in aliases}, weights)
    if problem:
        raise _mismatch(path, problem)
    if meta.get("weights_only") is True:  # no optimizer: training starts a fresh one
        return model
    problem = _optimizer_state_problem(state, parameter_specs(model), _kinds(model, optimizer))
    if problem:
        raise CheckpointError(f"{path}: its optimizer state does not match its model ({problem})",
                              "use another checkpoint")
    _check_groups(meta["optimizer_param_groups"], model, optimizer, bad)
    return model


def snapshot_model(meta: dict[str, Any], bad: Bad) -> ModelConfig:
    """The snapshot's model config, validated as model.json is."""
    try:
        return model_config_from_snapshot(meta["config"]["model"], "config.model")
    except ConfigError as exc:
        raise bad(exc.message) from None


def _mismatch(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: weights do not match its own model config ({what})", "use another checkpoint")


def _stored(path: Path, meta: dict[str, Any]) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """The weights and the optimizer state the checkpoint holds, as {name: spec} read from headers only; optimizer
    state is named "<parameter>/<state>" in both layouts."""
    if meta.get("layout", "full") == "full":
        if meta.get("weights_only") is True:
            return _header(path / "model.safetensors"), {}
        return _header(path / "model.safetensors"), _header(path / "optimizer.safetensors")
    weights, state = {}, {}
    for key, (shape, dtype) in sharded.stored_specs(path).items():
        if key.startswith("model."):
            weights[key.removeprefix("model.")] = TensorSpec(shape, dtype)
        elif key.startswith("optimizer.state."):
            parameter, _, name = key.removeprefix("optimizer.state.").rpartition(".")
            state[f"{parameter}/{name}"] = TensorSpec(shape, dtype)
    return weights, state


def _header(file: Path) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tensor.shape, tensor.torch_dtype)
            for name, tensor in read_header(file, CheckpointError, "use another checkpoint").items()}


def _kinds(model: ModelConfig, optimizer: str) -> dict[str, str]:
    """{parameter: the optimizer that steps it}: Muon's group is the last of a muon run, AdamW steps the rest."""
    from nanopt.train.optim.optimizer import group_names

    groups = group_names(list(meta_model(model).named_parameters()), optimizer)
    kind = "adamw" if optimizer == "muon" else optimizer
    return {name: "muon" if optimizer == "muon" and index == len(groups) - 1 else kind
            for index, names in enumerate(groups) for name in names}


def _optimizer_state_problem(state: dict[str, TensorSpec], params: dict[str, TensorSpec],
                             kinds: dict[str, str]) -> str | None:
    stored: dict[str, dict[str, TensorSpec]] = {}
    for key, spec in sorted(state.items()):
        parameter, separator, name = key.rpartition("/")
        if not separator or parameter not in params:
            return f"'{key[:80]}' is not the state of one of the model's parameters"
        stored.setdefault(parameter, {})[name] = spec
    for parameter, param in params.items():
        problem = _parameter_state_problem(parameter, param, stored.get(parameter, {}), kinds[parameter])
        if problem:
            return problem
    return None


def _parameter_state_problem(parameter: str, param: TensorSpec, stored: dict[str, TensorSpec],
                             kind: str) -> str | None:
    expected = _expected_state(param, stored, kind)
    if isinstance(expected, str):
        return f"'{parameter}': {expected}"
    for name, want in expected.items():
        have = stored.get(name)
        if have is None:
            return f"'{parameter}/{name}' is missing"
        if have != want:
            return f"'{parameter}/{name}' is {have}, {kind} keeps {want} for this parameter ({param})"
    for name in _LIKE_PARAMETER:  # amsgrad's: kept only by a run that asked for it
        if name in stored and name not in expected and not param.matches(stored[name]):
            return f"'{parameter}/{name}' is {stored[name]}, its parameter {param}"
    return None


def _expected_state(param: TensorSpec, stored: dict[str, TensorSpec], kind: str) -> dict[str, TensorSpec] | str:
    """{name: spec} of what `kind` keeps for `param`, or what makes `stored` impossible. 8-bit AdamW keeps a moment
    as its three parts (nanopt.train.optim.lowbit) or in fp32 (a tensor too small, or whose rows did not split into
    whole blocks on the ranks that wrote it): the stored names say which."""
    if kind == "muon":
        return {"momentum_buffer": param}
    expected = {"step": STEP}
    for moment in lowbit.SIGNED:
        parts = {f"{moment}_{part}": part for part in lowbit.PARTS}
        if kind == "adamw" or not set(parts) & set(stored):
            expected[moment] = param
        elif moment in stored:
            return f"its {moment} is stored both in fp32 and in 8 bits"
        elif not lowbit.quantizes(param.shape):
            return f"its {moment} is stored in 8 bits, which a parameter of shape {param.shape} never is"
        else:
            shapes = lowbit.stored_shapes(param.shape)
            expected.update({name: TensorSpec(shapes[part], lowbit.PART_DTYPES[part]) for name, part in parts.items()})
    return expected


def state_values_problem(state: dict[str, dict[str, Any]], step: int) -> str | None:
    """What is wrong with the first value, in parameter order, that no optimizer writes: a non-finite moment, scale
    or code book (it would surface steps later as a diverged run, blamed on the learning rate), a negative second
    moment or scale, a step count that is not a whole number from 0 to the checkpoint's `step`. `state`: {parameter:
    {name: tensor}} as loaded (of a DTensor, this rank's part); names no optimizer of nanopt keeps are left alone."""
    for parameter, entry in sorted(state.items()):
        for name, value in sorted(entry.items()):
            problem = _value_problem(name, value.to_local() if isinstance(value, DTensor) else value, step)
            if problem:
                return f"'{parameter}/{name}' {problem}"
    return None


def _value_problem(name: str, tensor: torch.Tensor, step: int) -> str | None:
    if name == "step":
        count = float(tensor)
        # A state made before the first step counts 1: torch creates it with one step of zero gradients.
        if not (math.isfinite(count) and count == int(count) and 0 <= count <= max(step, 1)):
            return f"is {count:g}, not a step count from 0 to the checkpoint's step {step}"
        return None
    if name not in _EIGHT_BIT and name not in _LIKE_PARAMETER or not tensor.is_floating_point():
        return None
    if not bool(torch.isfinite(tensor).all()):
        return "holds a non-finite value (NaN or infinity)"
    if name in _NON_NEGATIVE and bool((tensor < 0).any()):
        return "holds a negative value, which this state never does"
    return None


def _check_groups(groups: list[dict[str, Any]], model: ModelConfig, optimizer: str, bad: Bad) -> None:
    """The saved groups replace the live optimizer's on load, group by group: their number and the parameters in
    each must be build_optimizer's."""
    from nanopt.train.optim.optimizer import group_names

    expected = group_names(list(meta_model(model).named_parameters()), optimizer)
    if len(groups) != len(expected):
        raise bad(f"'optimizer_param_groups' holds {len(groups)} groups, {optimizer} has {len(expected)}")
    for index, (group, names) in enumerate(zip(groups, expected, strict=True)):
        if len(set(group["params"])) != len(group["params"]) or set(group["params"]) != set(names):
            raise bad(f"optimizer_param_groups[{index}] lists other parameters than {optimizer}'s group {index}")
        kind = "muon" if optimizer == "muon" and index == len(expected) - 1 else "adamw"  # Muon's group is last
        unknown = sorted(set(group) - _group_keys(kind))
        if unknown:  # torch's loader looks each key up in the live optimizer's groups
            raise bad(f"optimizer_param_groups[{index}] holds {unknown[0][:40]!r}, which this torch's optimizer "
                      "does not have")


@functools.cache
def _group_keys(kind: str) -> frozenset[str]:
    """The keys of a param group of this torch's AdamW or Muon (learnt from one on the meta device)."""
    import torch

    param = torch.nn.Parameter(torch.empty(2, 2, device="meta"))
    optimizer = torch.optim.AdamW([param]) if kind == "adamw" else torch.optim.Muon([param])
    return frozenset(optimizer.param_groups[0])
