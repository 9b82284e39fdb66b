"""A checkpoint's stored tensors and optimizer groups against its own config snapshot, before anything is loaded.

The snapshot is validated as model.json is (nanopt.config.model_config_from_snapshot), the model it describes is
built on the meta device (nanopt.model.layout), and the stored side is read from file headers only: the safetensors
headers of a one-process checkpoint (nanopt.safetensors_header, which checks each file's own integrity), the shard
index of a sharded one. Every weight must be there with the model's shape and dtype and nothing else; optimizer
state only for the model's parameters, shaped like them; the optimizer's parameter groups exactly those
build_optimizer makes; the tied names and the EOS id the model's. Only then does eval, export or train allocate
anything, so a snapshot can never ask for memory the files do not back (a 1.7 GB model from a 270 KB checkpoint),
and a damaged or crafted checkpoint is skipped or refused in one line instead of failing in torch.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig, model_config_from_snapshot
from nanopt.errors import CheckpointError, ConfigError
from nanopt.model.layout import TensorSpec, meta_model, mismatch, parameter_specs, tensor_specs, tied_aliases
from nanopt.safetensors_header import read_header
from nanopt.train import sharded
from nanopt.train.meta_fields import Bad

# Optimizer state shaped like its parameter (AdamW's moments, Muon's momentum); "step" is a scalar. Other names
# (a newer torch's) are left to the optimizer, which reads only the names it knows.
_LIKE_PARAMETER = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
OPTIMIZERS = ("adamw", "muon", "adamw8bit")


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
    params = parameter_specs(model)
    problem = _optimizer_state_problem(state, params)
    if problem:
        raise _mismatch(path, f"optimizer state: {problem}")
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


def _optimizer_state_problem(state: dict[str, TensorSpec], params: dict[str, TensorSpec]) -> str | None:
    for key, spec in sorted(state.items()):
        parameter, separator, name = key.rpartition("/")
        if not separator or parameter not in params:
            return f"'{key[:80]}' is not the state of one of the model's parameters"
        if name == "step" and spec.shape != ():
            return f"'{key}' is {spec}, not a scalar"
        if name in _LIKE_PARAMETER and not params[parameter].matches(spec):
            return f"'{key}' is {spec}, its parameter {params[parameter]}"
    return None


def _check_groups(groups: list[dict[str, Any]], model: ModelConfig, optimizer: str, bad: Bad) -> None:
    """The saved groups replace the live optimizer's on load, group by group: their number and the parameters in
    each must be build_optimizer's."""
    from nanopt.train.optim import group_names

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
