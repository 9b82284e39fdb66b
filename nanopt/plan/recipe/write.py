"""A plan as the record `nanopt plan` prints and keeps (RUN/plan.json), and the run directory it writes: model.json,
train.json and plan.json, made in a staging directory beside RUN and renamed to RUN once complete, so RUN either
does not exist or is a whole run; nothing is written over an existing directory that is not empty."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.files import make_dir, new_dir, remove_tree, write_file
from nanopt.model.flops import count_params
from nanopt.plan.estimate.budget import compute_optimal
from nanopt.plan.recipe import cadence, rule
from nanopt.rundir import MODEL_FILE, PLAN_FILE, TRAIN_FILE, staged
from nanopt.untrusted_text import shell_word

if TYPE_CHECKING:
    from nanopt.plan.recipe.budget import Budget
    from nanopt.plan.recipe.cadence import Cadence
    from nanopt.plan.recipe.data import DataSplits
    from nanopt.plan.recipe.options import Device, Memory, PlanOptions

FORMAT_VERSION = 1
CHINCHILLA_RATIO = 20.0  # tokens per parameter at the compute optimum (Hoffmann et al. 2022)
# train.json's keys a plan writes: what it chose, and the optimizer settings the rule was fitted with (DeepSeek LLM:
# AdamW, betas 0.9 / 0.95, weight decay 0.1, gradient clipping 1.0), so the file says them rather than leaning on
# defaults.
TRAIN_KEYS = ("data", "micro_batch_size", "global_batch_tokens", "train_tokens", "seq_len", "learning_rate",
              "min_lr_ratio", "lr_schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "grad_clip",
              "eval_interval", "eval_tokens", "checkpoint_interval", "keep_checkpoints", "log_interval", "precision",
              "compile", "activation_checkpointing", "parallelism", "optimizer")


def plan_record(opts: PlanOptions, budget: Budget, device: Device, splits: DataSplits, compute: float,
                run: RunConfig, memory: Memory, timing: Cadence, prediction: dict[str, Any]) -> dict[str, Any]:
    train, model, steps = run.train, run.model, run.total_steps
    rule_compute = rule.rule_compute(model, run.seq_len, run.total_tokens)
    seconds = prediction["seconds"]
    return {
        "version": FORMAT_VERSION, "run": str(opts.out),
        "budget": {"text": budget.text, "kind": budget.kind, "amount": budget.amount, "as_said": budget.describe()},
        "device": {"gpu": device.gpu, "name": device.target.name, "num_gpus": device.num_gpus,
                   "peak_tflops": device.target.peak_flops / 1e12, "mfu": device.mfu, "precision": device.precision,
                   "memory_bytes": device.target.memory_bytes, "price_per_hour": device.target.usd_per_hour},
        "compute": {"train_flops": compute, "chinchilla_tokens_per_param": CHINCHILLA_RATIO,
                    "optimal_params": compute_optimal(compute, CHINCHILLA_RATIO).params},
        "model": {"params": count_params(model).total, "layers": model.num_hidden_layers,
                  "hidden_size": model.hidden_size, "heads": model.num_attention_heads,
                  "kv_heads": model.num_key_value_heads, "vocab_size": model.vocab_size, "seq_len": run.seq_len},
        "rule": {"source": rule.SOURCE, "flops_per_token": rule.rule_flops_per_token(model, run.seq_len),
                 "compute": rule_compute, "learning_rate": train.learning_rate,
                 "batch_tokens": rule.batch_tokens(rule_compute), "note": rule.extrapolated(rule_compute)},
        "batch": {"global_batch_tokens": train.global_batch_tokens, "micro_batch_size": train.micro_batch_size,
                  "max_micro_batch": memory.max_micro_batch, "grad_accum": run.grad_accum_steps(device.num_gpus),
                  "rung": memory.rung, "settings": memory.settings,
                  "peak_memory_bytes": prediction["peak_memory_bytes"]},
        "data": {"path": str(opts.data), "train_split_tokens": splits.train_tokens,
                 "train_tokens_needed": run.total_tokens + 1, "epochs": run.total_tokens / splits.train_tokens,
                 "max_epochs": opts.max_epochs, "val_split_tokens": splits.val_tokens,
                 "test_split_tokens": splits.test_tokens},
        "schedule": {"steps": steps, "train_tokens": run.total_tokens, "warmup_steps": train.warmup_steps,
                     "lr_schedule": train.lr_schedule, "min_lr_ratio": train.min_lr_ratio},
        "cadence": {"eval_interval": train.eval_interval, "eval_tokens": train.eval_tokens,
                    "evaluations": prediction["evaluations"], "eval_share": _share(seconds, "eval"),
                    "eval_share_limit": cadence.EVAL_SHARE, "checkpoint_interval": train.checkpoint_interval,
                    "checkpoints": prediction["checkpoints"], "checkpoint_share": _share(seconds, "checkpoint"),
                    "checkpoint_share_limit": cadence.CHECKPOINT_SHARE, "lost_s": timing.lost_s,
                    "lost_share": timing.lost_s / seconds["train"], "lost_limit_s": timing.lost_limit_s,
                    "lost_by_cost": timing.lost_s > timing.lost_limit_s + 1e-9},
        "prediction": prediction,
        "next": next_commands(opts.out, device.num_gpus, device.on_cpu),
        "model_json": {"_note": _model_note(budget, compute, model), **model.to_dict()},
        "train_json": {"_note": _train_note(budget, rule_compute), **{k: train.to_dict()[k] for k in TRAIN_KEYS},
                       **({"price_per_hour": train.price_per_hour} if train.price_per_hour is not None else {})},
    }


def _share(seconds: dict[str, float], phase: str) -> float:
    """A phase's share of its own time and the steps' (as the limits of nanopt.plan.recipe.cadence are put)."""
    return seconds[phase] / (seconds[phase] + seconds["train"])


def next_commands(out: Path, gpus: int, on_cpu: bool) -> list[str]:
    run = shell_word(out)
    launch = f" --nproc-per-node {gpus}" if gpus > 1 else ""
    first = [] if on_cpu else [f"nanopt preflight {run}{launch}"]
    return [*first, f"nanopt train {run}{launch}", f"nanopt eval {run}"]


def _model_note(budget: Budget, compute: float, model: Any) -> str:
    return (f"nanopt plan --budget {budget.text}: the compute-optimal size for {compute:.3g} training FLOPs "
            f"({CHINCHILLA_RATIO:g} tokens per parameter), {count_params(model).total:,} parameters")


def _train_note(budget: Budget, rule_compute: float) -> str:
    return (f"nanopt plan --budget {budget.text}: peak learning rate and global batch from DeepSeek LLM's fits "
            f"(Bi et al. 2024) at C = {rule_compute:.3g}; evaluation under {cadence.EVAL_SHARE:.0%} of the steps' "
            "time; plan.json says why each number is what it is (docs/budget.md)")


def check_out(out: Path) -> None:
    """Before any planning: RUN must be new, or an empty directory."""
    if os.path.lexists(out) and not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        raise ConfigError(f"--out {shell_word(out)}: already exists, and nanopt plan writes a new run directory",
                          "choose a new path such as runs/NEW, or remove it")


def write_run(plan: dict[str, Any], out: Path) -> None:
    """model.json, train.json and plan.json into a staging directory beside `out`, renamed to `out` once complete."""
    check_out(out)
    make_dir(out.parent, parents=True)
    stage = staged(out)
    if os.path.lexists(stage):  # what a writer killed before its rename left
        remove_tree(stage, out.parent)
    new_dir(stage)
    try:
        record = {k: v for k, v in plan.items() if k not in ("model_json", "train_json")}
        for name, data in ((MODEL_FILE, plan["model_json"]), (TRAIN_FILE, plan["train_json"]), (PLAN_FILE, record)):
            write_file(stage / name, json.dumps(data, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # empty (check_out): the staged directory takes its place
        os.rename(stage, out)
    except BaseException:
        remove_tree(stage, out.parent, quiet=True)
        raise
