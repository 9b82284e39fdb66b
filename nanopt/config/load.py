"""model.json and train.json read from a run directory (with `--set` overrides), and the same configs read back
from a checkpoint's snapshot, validated exactly alike."""

from __future__ import annotations

import os
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
        if isinstance(raw, dict):
            raw = {**_left_standing(raw, overrides), **_from_command_line(overrides)}
        source = f"{train_path} (with --set {', '.join(overrides)})"
    train = from_dict(TrainConfig, _read_token_counts(raw, source), source)
    train.validate(model, source)
    return RunConfig(run_dir=run_dir, model=model, train=train)


def _from_command_line(overrides: dict[str, Any]) -> dict[str, Any]:
    """`--set data=DIR` is typed in a shell, so a relative DIR is relative to the current directory, as every other
    path on the command line is; it is made absolute before it joins train.json's values."""
    data = overrides.get("data")
    if isinstance(data, str) and data.strip() and "\0" not in data:
        return {**overrides, "data": os.path.abspath(data)}
    return overrides


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
