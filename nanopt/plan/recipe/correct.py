"""A planned run corrected from its preflight: `nanopt plan` assumed an MFU; `nanopt preflight` measured the real
step, setup, evaluation and checkpoint on the machine. With those, the budget buys a different number of steps.

What is kept: the model, the sequence length, the micro-batch, the global batch and the memory rung, because they
are what the preflight measured (its fingerprint: changing any of them would make the measurement another run's).
What is re-made at the measured rate: the training tokens (whole steps that fill the budget's time after the
measured setup, less the shares kept for evaluation, checkpoints and other time), the peak learning rate (the
rule's at the new compute), the warmup, and the evaluation, checkpoint and log intervals. A FLOPs budget fixes the
steps: only its predicted time and cost move. A run that has started is never rewritten: its schedule is in its
checkpoints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.files import replace_file
from nanopt.parsing import read_json
from nanopt.plan.prediction import Hardware, checkpoint_seconds, predict
from nanopt.plan.recipe import cadence, rule
from nanopt.plan.recipe.budget import parse_budget
from nanopt.plan.recipe.data import check_epochs, read_splits
from nanopt.plan.recipe.planner import MIN_STEPS, RESERVED
from nanopt.rundir import RunDir

# train.json's keys a correction may change, in the order they are shown
CORRECTED_KEYS = ("train_tokens", "learning_rate", "warmup_steps", "log_interval", "eval_interval", "eval_tokens",
                  "checkpoint_interval")


@dataclass(frozen=True)
class Correction:
    changes: list[tuple[str, Any, Any]]  # (train.json key, planned, corrected)
    before: dict[str, Any]  # the plan's prediction at the measured rate, before the correction
    after: dict[str, Any]  # the corrected run's prediction
    run: RunConfig
    why: str  # one line: what the measurement changed
    written: bool = False


def planned_budget(run: RunConfig) -> tuple[dict[str, Any], Any] | None:
    """(plan.json's record, its budget) for a run `nanopt plan` wrote, else None."""
    path = RunDir(run.run_dir).plan_json
    if not path.is_file():
        return None
    record = read_json(path, contents_hint="write the run again with `nanopt plan`")
    text = record.get("budget", {}).get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ConfigError(f"{path}: no budget text", "write the run again with `nanopt plan`")
    return record, parse_budget(text)


def correct_plan(run: RunConfig, world_size: int) -> Correction | None:
    """The corrected run when `run` was planned and its preflight.json matches it; None otherwise."""
    found = planned_budget(run)
    if found is None:
        return None
    record, budget = found
    hardware = _hardware(record, run, world_size)
    before = predict(run, hardware, "nanopt preflight")
    if before["throughput"]["source"] != "preflight":
        return None
    if budget.kind == "flops":
        return Correction([], before, before, run, f"a FLOPs budget ({budget.text}) fixes the steps; only their "
                          "predicted time and cost follow the measurement")
    seconds = _budget_seconds(budget, before, hardware)
    steps = math.floor((seconds - before["seconds"]["setup"]) / (1 + RESERVED) / before["step_s"])
    if steps < MIN_STEPS:
        raise ConfigError(f"at the measured {before['tokens_per_s']:,.0f} tokens/s the budget {budget.text} buys "
                          f"{steps} optimizer steps, fewer than {MIN_STEPS}",
                          f"plan again with a larger --budget, or with --mfu {before['throughput']['mfu']:.3g}")
    corrected = _corrected_run(run, steps, before, record)
    after = predict(corrected, hardware, "nanopt preflight")
    changes = [(key, getattr(run.train, key), getattr(corrected.train, key)) for key in CORRECTED_KEYS
               if getattr(run.train, key) != getattr(corrected.train, key)]
    why = (f"measured {before['tokens_per_s']:,.0f} tokens/s and {before['seconds']['setup']:.0f} s of setup: "
           f"{budget.text} buys {steps:,} steps where the plan assumed {run.total_steps:,}")
    return Correction(changes, before, after, corrected, why)


def _hardware(record: dict[str, Any], run: RunConfig, world_size: int) -> Hardware:
    device = record.get("device") if isinstance(record.get("device"), dict) else {}
    gpu = device.get("gpu") if isinstance(device.get("gpu"), str) else "cpu"
    return Hardware(gpu, world_size, run.train.price_per_hour)


def _budget_seconds(budget: Any, prediction: dict[str, Any], hardware: Hardware) -> float:
    if budget.kind == "seconds":
        return budget.amount
    price = prediction["price_per_hour"]
    if not price:
        raise ConfigError(f"the budget {budget.text} is money, and this device has no price per hour",
                          "set price_per_hour in train.json")
    return budget.amount / (price * prediction["device"]["num_gpus"]) * 3600


def _corrected_run(run: RunConfig, steps: int, measured: dict[str, Any], record: dict[str, Any]) -> RunConfig:
    train = run.train
    tokens = steps * train.global_batch_tokens
    splits = read_splits(run.data_dir)
    max_epochs = record.get("data", {}).get("max_epochs", 4.0)
    check_epochs(splits, run.data_dir, tokens, max_epochs if isinstance(max_epochs, (int, float)) else 4.0,
                 run.seq_len, lambda factor: None)
    eval_tokens = cadence.eval_tokens_for(tokens, run.seq_len, splits.val_tokens)
    eval_s = measured["eval_s"] * eval_tokens / max(train.eval_tokens, 1)
    timing = cadence.cadence_for(steps, measured["step_s"], eval_tokens, eval_s,
                                 measured.get("checkpoint_s") or checkpoint_seconds(run, 1))
    corrected = replace(train, train_tokens=tokens, max_steps=None,
                        learning_rate=rule.learning_rate(rule.rule_compute(run.model, run.seq_len, tokens)),
                        warmup_steps=timing.warmup_steps, log_interval=timing.log_interval,
                        eval_interval=timing.eval_interval, eval_tokens=timing.eval_tokens,
                        checkpoint_interval=timing.checkpoint_interval)
    return replace(run, train=corrected)


def write_correction(correction: Correction) -> Correction:
    """The corrected keys into train.json (the rest of the file as it is) and the correction into plan.json, each
    replaced whole; refused for a run that has started."""
    rundir = RunDir(correction.run.run_dir)
    if rundir.metrics.exists() or rundir.checkpoints.exists():
        raise ConfigError(f"{rundir.root}: has started training, so its plan is not corrected (its schedule is in "
                          "its checkpoints)", "plan a new run to train at the measured rate")
    train_json = read_json(rundir.train_json)
    for key, _, value in correction.changes:
        train_json[key] = value
    if any(key == "train_tokens" for key, _, _ in correction.changes):
        train_json.pop("max_steps", None)  # train.json takes one of the two
    record = read_json(rundir.plan_json)
    record["corrected"] = {"by": "nanopt preflight", "why": correction.why,
                           "changes": {key: {"planned": old, "corrected": new} for key, old, new in correction.changes},
                           "prediction": correction.after}
    replace_file(rundir.train_json, json.dumps(train_json, indent=2) + "\n")
    replace_file(rundir.plan_json, json.dumps(record, indent=2) + "\n")
    return replace(correction, written=True)
