"""`nanopt estimate --flops C`: plan a run from a compute budget.

The compute-optimal split of C FLOPs between parameters N and tokens D under the Chinchilla approximation
C = 6·N·D with D = ratio·N (Hoffmann et al. 2022: about 20 tokens per parameter; a larger ratio over-trains a
smaller model on purpose, as the LLaMA models did):

    N = sqrt(C / (6 · ratio)),  D = ratio · N

and a concrete model of the architecture's family (layers, width, heads) whose exact parameter count
(nanopt.model.flops.count_params, the built model's own count) is within SHAPE_TOLERANCE of N, the most balanced
such shape (width / layers nearest the family's usual aspect ratio). Pure arithmetic, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.files import make_dir, replace_file
from nanopt.hardware import is_cpu
from nanopt.model.flops import count_params, flops_per_token, train_seconds
from nanopt.plan.estimate.options import EstimateOptions
from nanopt.plan.estimate.target import target_for

# Width / depth of the families' published shapes: GPT-2 small 768 / 12 = 64; Llama 3.2 1B 2048 / 16 and
# Llama 2 7B 4096 / 32 = 128.
TARGET_ASPECT = {"gpt2": 64, "llama": 128}
SHAPE_TOLERANCE = 0.02  # a shape within 2% of the optimum counts as "close"; the most balanced of those wins
MAX_LAYERS = 256
MAX_HIDDEN = 65_536

# The family's fixed parts when no run directory is given: the shipped runs/gpt2-small and runs/llama-3.2-1b.
FAMILY_TEMPLATES = {
    "gpt2": ModelConfig(architecture="gpt2", vocab_size=50304, hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=1024),
    "llama": ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=2048, rope_theta=500000.0),
}


@dataclass(frozen=True)
class ComputeOptimum:
    flops: float
    tokens_per_param: float
    params: int
    tokens: int


def compute_optimal(flops: float, tokens_per_param: float) -> ComputeOptimum:
    """N = sqrt(C / (6 ratio)) rounded to a whole parameter, D = ratio x N rounded to a whole token."""
    params = max(1, round(math.sqrt(flops / (6 * tokens_per_param))))
    return ComputeOptimum(flops, tokens_per_param, params, max(1, round(tokens_per_param * params)))


def head_dim_for(architecture: str, hidden: int) -> int:
    # 64-wide heads as GPT-2 and Llama 3.2 1B; 128 for the wider Llamas (7B and up)
    return 128 if architecture == "llama" and hidden > 2048 else 64


def shape(template: ModelConfig, layers: int, hidden: int) -> ModelConfig:
    """The template's family (vocabulary, positions, tying, options) at `layers` x `hidden`: heads of
    head_dim_for's width, the template's queries per KV head, its MLP width ratio (rounded to 64)."""
    heads = hidden // head_dim_for(template.architecture, hidden)
    group = template.num_attention_heads // template.num_key_value_heads
    kv_heads = heads // group if heads % group == 0 else heads
    ratio = template.intermediate_size / template.hidden_size
    intermediate = max(64, 64 * round(ratio * hidden / 64))
    return dataclasses.replace(template, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                               num_key_value_heads=kv_heads, intermediate_size=intermediate)


def widths(template: ModelConfig) -> list[int]:
    """The widths a planned model may have, ascending: whole heads of head_dim_for's width, in whole groups of the
    template's queries per KV head."""
    group = template.num_attention_heads // template.num_key_value_heads
    steps = {hidden for hidden in range(64 * group, MAX_HIDDEN + 1, 64 * group)}
    return sorted(hidden for hidden in steps
                  if hidden % (head_dim_for(template.architecture, hidden) * group) == 0)


def closest_width(template: ModelConfig, layers: int, target: int,
                   candidates: list[int]) -> tuple[ModelConfig, int]:
    """The width of `candidates` whose count is closest to `target`; the count grows with the width, so a
    bisection finds it."""
    low, high = 0, len(candidates) - 1
    while low < high:
        mid = (low + high) // 2
        if count_params(shape(template, layers, candidates[mid])).total < target:
            low = mid + 1
        else:
            high = mid
    options = [shape(template, layers, candidates[i]) for i in {max(0, low - 1), low}]
    best = min(options, key=lambda cfg: abs(count_params(cfg).total - target))
    return best, count_params(best).total


def model_for(template: ModelConfig, params: int) -> ModelConfig:
    """The most balanced shape of the template's family whose parameter count is within SHAPE_TOLERANCE of
    `params`; the closest count when none is (a budget so small the embeddings alone exceed it)."""
    grid = widths(template)
    candidates = [closest_width(template, layers, params, grid) for layers in range(1, MAX_LAYERS + 1)]
    aspect = TARGET_ASPECT[template.architecture]

    def imbalance(cfg: ModelConfig) -> float:
        return abs(math.log(cfg.hidden_size / cfg.num_hidden_layers / aspect))

    close = [cfg for cfg, count in candidates if abs(count / params - 1) <= SHAPE_TOLERANCE]
    if close:
        return min(close, key=imbalance)
    return min(candidates, key=lambda pair: (abs(pair[1] - params), imbalance(pair[0])))[0]


def template_for(model: ModelConfig | None, family: str | None) -> ModelConfig:
    """The run's model.json as the family template, or the built-in one `--family` names (default llama)."""
    if model is not None and family is not None:
        raise ConfigError("--family with a run directory: the run's model.json already names the family",
                          "leave out --family, or leave out the run directory")
    if model is not None:
        return model
    if family is not None and family not in FAMILY_TEMPLATES:
        raise ConfigError(f"--family {family!r} is not an architecture nanopt builds", "use llama or gpt2")
    return FAMILY_TEMPLATES[family or "llama"]


def model_json(cfg: ModelConfig) -> dict[str, Any]:
    """The shape as a model.json: every key, so the file says exactly what `nanopt train` builds."""
    return {"_note": f"nanopt estimate --flops: {count_params(cfg).total:,} parameters", **cfg.to_dict()}


def plan_budget(model: ModelConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    """The report of `estimate --flops`: the optimum, the model shape planned for it and what C FLOPs take on
    the chosen devices at the assumed MFU (options already completed by the caller: GPU, count, MFU, price)."""
    optimum = compute_optimal(opts.flops, opts.tokens_per_param)
    cfg = model_for(template_for(model, opts.family), optimum.params)
    count = count_params(cfg).total
    target = target_for(opts, "fp32" if is_cpu(opts.gpu) else "bf16")
    seconds = train_seconds(opts.flops, opts.num_gpus, target.peak_flops, opts.mfu)
    cost = None if target.usd_per_hour is None else seconds / 3600 * opts.num_gpus * target.usd_per_hour
    return {
        "flops": opts.flops, "tokens_per_param": opts.tokens_per_param,
        "optimal_params": optimum.params, "optimal_tokens": optimum.tokens,
        "model": model_json(cfg), "model_params": count, "model_params_vs_optimal": count / optimum.params,
        # what C buys the planned shape under the same 6ND rule, and its PaLM FLOPs per token (attention incl.)
        "model_tokens": max(1, round(opts.flops / (6 * count))),
        "model_flops_per_token": flops_per_token(cfg, cfg.max_position_embeddings),
        "train_seconds": seconds, "train_hours": seconds / 3600, "cost_usd": cost,
        "gpu": {"key": target.key, "name": target.name, "peak_tflops": target.peak_flops / 1e12,
                "peak_source": target.peak_source, "usd_per_hour": target.usd_per_hour, "num_gpus": opts.num_gpus,
                "mfu": opts.mfu, "note": target.note},
        "model_json_written": None,
    }


def write_model_json(path: Path, model: dict[str, Any]) -> None:
    """The planned model.json at `path`, a new file (never over an existing one, never through a link), in a
    directory made if missing (a new run directory), written whole or not at all (nanopt.files.replace_file)."""
    if os.path.lexists(path):
        raise ConfigError(f"--write-model {path}: already exists, and nanopt does not overwrite a model.json",
                          "choose a new path, e.g. runs/NEW/model.json, or remove the file")
    make_dir(Path(path).parent, parents=True)
    replace_file(path, json.dumps(model, indent=2) + "\n")
