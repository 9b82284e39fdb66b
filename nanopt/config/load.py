"""model.json and train.json read from a run directory (with `--set` overrides), and the same configs read back
from a checkpoint's snapshot, validated exactly alike."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from nanopt.config.model_config import ModelConfig
from nanopt.config.schema import BUDGET_KEYS, TOKEN_COUNT_KEYS, RunConfig, TrainConfig
from nanopt.errors import ConfigError
from nanopt.parsing import from_dict, parse_token_count, path_kind, read_json
from nanopt.rundir import RunDir


def load_model_config(path: Path) -> ModelConfig:
    cfg = from_dict(ModelConfig, read_json(path), str(path))
    cfg.validate(str(path))
    return cfg


def load_run(run_dir: Path | str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load and validate runs/NAME/model.json and train.json, applying `--set` overrides to train.json."""
    run_dir = Path(run_dir)
    kind = path_kind(run_dir, ConfigError, "pass a run directory such as runs/demo")
    if kind == "file":
        raise ConfigError(f"{run_dir}: is a file, not a run directory",
                          "pass the directory that holds model.json and train.json, e.g. runs/demo")
    if kind == "missing":
        raise ConfigError(f"{run_dir}: run directory not found",
                          "create one with model.json and train.json, or copy runs/demo")
    paths = RunDir(run_dir)
    model = load_model_config(paths.model_json)
    train_path = paths.train_json
    raw = read_json(train_path)
    source = str(train_path)
    if overrides:
        _refuse_model_keys(overrides, paths.model_json)
        if isinstance(raw, dict):
            raw = {**_left_standing(raw, overrides), **_from_command_line(overrides)}
        source = f"{train_path} (with --set {', '.join(overrides)})"
    train = from_dict(TrainConfig, _read_token_counts(raw, source), source)
    train.validate(model, source)
    return RunConfig(run_dir=run_dir, model=model, train=train, set_on_command_line=frozenset(overrides or ()))


def _refuse_model_keys(overrides: dict[str, Any], model_json: Path) -> None:
    """A model.json key given to --set: the model's shape is not overridden from the command line (a checkpoint,
    a dataset's vocabulary and the memory estimate all follow model.json), so say where the key lives instead of
    listing train.json's keys as if it were a typo."""
    model_keys = {f.name for f in fields(ModelConfig)}
    for key, value in overrides.items():
        if key in model_keys:
            shown = json.dumps(value)
            raise ConfigError(f"--set {key}={shown}: {key} is a key of model.json, and --set changes train.json only",
                              f'edit {model_json}: "{key}": {shown}')


def _from_command_line(overrides: dict[str, Any]) -> dict[str, Any]:
    """`--set data=DIR` is typed in a shell, so a relative DIR is relative to the current directory, as every other
    path on the command line is; it is made absolute before it joins train.json's values. So are the paths of a
    mixture given with `--set 'data={...}'`."""
    data = overrides.get("data")
    if _plain_path(data):
        return {**overrides, "data": os.path.abspath(data)}
    if isinstance(data, dict):
        return {**overrides, "data": {name: _mixture_source(name, value) for name, value in data.items()}}
    return overrides


def _mixture_source(name: str, value: Any) -> Any:
    """One source of a mixture typed on the command line, its path absolute. A source keyed by its path
    ({"data/web": 0.7}) keeps that key as its name and gets the path beside it, so a phase still names it as
    typed. Anything malformed is left for the mixture's own checks to name."""
    if isinstance(value, dict):
        path = value.get("path")
        return {**value, "path": os.path.abspath(path)} if _plain_path(path) else value
    if _plain_path(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"path": os.path.abspath(name), "weight": value}
    return value


def _plain_path(value: Any) -> bool:
    """A string os.path.abspath can take: not empty or blank, no NUL byte."""
    return isinstance(value, str) and bool(value.strip()) and "\0" not in value


def _left_standing(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """train.json's values that `--set` leaves standing. Setting one budget key (train_tokens or max_steps) from the
    command line replaces the file's other one too, as a run has one budget: `--set train_tokens=5M` on a run with
    max_steps just works. Naming both on the command line (`--set max_steps=50 --set train_tokens=null`) decides
    both."""
    given = [key for key in BUDGET_KEYS if overrides.get(key) is not None]
    if len(given) != 1:
        return raw
    other = next(key for key in BUDGET_KEYS if key != given[0])
    return raw if other in overrides else {key: value for key, value in raw.items() if key != other}


def _read_token_counts(raw: Any, source: str) -> Any:
    """The token-count keys given as text ("2.5B") as the integers they mean; an unreadable one is a ConfigError
    naming the file and the key. Anything else is from_dict's to check."""
    if not isinstance(raw, dict):
        return raw
    return {key: parse_token_count(value, f"{source}: key '{key}':")
            if key in TOKEN_COUNT_KEYS and isinstance(value, str) else value for key, value in raw.items()}


def model_config_from_snapshot(data: Any, source: str = "checkpoint meta.json model config") -> ModelConfig:
    """A checkpoint's model snapshot, validated as model.json is: eval and export build the model from it."""
    cfg = from_dict(ModelConfig, data, source)
    cfg.validate(source)
    return cfg


def train_config_from_snapshot(data: Any, model: ModelConfig,
                               source: str = "checkpoint meta.json train config") -> TrainConfig:
    """A checkpoint's train snapshot, validated exactly as train.json is (its dataset path as text only)."""
    train = from_dict(TrainConfig, data, source)
    train.validate(model, source, look_up_data=False)
    return train
