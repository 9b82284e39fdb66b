"""Typed configs for runs/NAME/model.json and train.json: load, validate, derive, save.

Key names follow Hugging Face `transformers` config names where one exists. Every mistake a person can type
(unknown key, wrong type, impossible shape) is a ConfigError naming the file and the key, with a hint.

`model_config` holds model.json's dataclass (and `rope_scaling` the checks of its Llama 3 RoPE scaling), `schema`
train.json's and the run's, `checks` the range checks they share; `load` reads them from a run directory or a
checkpoint's snapshot.
"""

from nanopt.config.load import load_model_config, load_run, model_config_from_snapshot, train_config_from_snapshot
from nanopt.config.model_config import MAX_MODEL_DIMENSION, ModelConfig
from nanopt.config.schema import TOKEN_COUNT_KEYS, RunConfig, TrainConfig

__all__ = ["MAX_MODEL_DIMENSION", "TOKEN_COUNT_KEYS", "ModelConfig", "RunConfig", "TrainConfig", "load_model_config",
           "load_run", "model_config_from_snapshot", "train_config_from_snapshot"]
