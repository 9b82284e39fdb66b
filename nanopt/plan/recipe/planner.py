"""`nanopt plan`: from a budget (money, time or FLOPs) on a device to a complete run directory.

1. The budget becomes the training steps' compute C: a time or money budget less the setup allowance and the
   shares reserved for evaluation, checkpoints and other time (nanopt.plan.recipe.cadence, nanopt.plan.prediction),
   at the device's dense peak x the assumed MFU, slowed by the memory ladder's rung. On a CPU (the machine the run
   will train on) the planned step is then measured, and the plan made again at the measured MFU.
2. C gives the compute-optimal parameter count (Chinchilla's 20 tokens per parameter: nanopt.plan.estimate.budget)
   and a shape of the family near it (nanopt.plan.recipe.shape); the tokens are what C buys that shape at
   nanopt's FLOPs per token.
3. DeepSeek LLM's fits give the peak learning rate and the global batch at that compute (nanopt.plan.recipe.rule).
4. The memory model gives the rung and the largest micro-batch; the predicted step time gives the evaluation and
   checkpoint intervals (nanopt.plan.recipe.cadence).

Every refusal (a dataset too small for the budget, a budget too small for the smallest sensible model) is one
ConfigError before anything is written. Writing the directory: nanopt.plan.recipe.write.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig, RunConfig, TrainConfig
from nanopt.errors import ConfigError
from nanopt.hardware import is_cpu
from nanopt.model.flops import count_params, flops_per_token
from nanopt.plan.estimate import DEFAULT_MFU, EstimateOptions
from nanopt.plan.estimate.budget import compute_optimal
from nanopt.plan.estimate.ladder import ladder
from nanopt.plan.estimate.target import has_bf16, run_memory, run_precision, target_for
from nanopt.plan.prediction import OTHER_SHARE, Hardware, checkpoint_seconds, eval_seconds, predict
from nanopt.plan.preflight_record import fingerprint
from nanopt.plan.recipe import cadence, probe, rule
from nanopt.plan.recipe.budget import Budget, parse_budget
from nanopt.plan.recipe.data import DataSplits, check_epochs, read_splits
from nanopt.plan.recipe.options import Device, Memory, PlanOptions
from nanopt.plan.recipe.shape import MIN_SEQ_LEN, TOO_SMALL, TooSmall, choose_model, seq_len_for, smallest_params
from nanopt.plan.recipe.write import CHINCHILLA_RATIO, plan_record

MIN_STEPS = 50
MAX_PROBES = 3  # measurements of the planned step on a CPU
RESERVED = cadence.EVAL_SHARE + cadence.CHECKPOINT_SHARE + OTHER_SHARE  # of the steps' time, beside them


def make_plan(opts: PlanOptions, on_measure: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The plan as one JSON-ready dict: plan.json's record, and the two configs to write under "model_json" and
    "train_json" (nanopt.plan.recipe.write). On a CPU with no --mfu the planned step is measured on this machine
    (nanopt.plan.recipe.probe), and `on_measure` hears before each measurement."""
    opts.validate()
    budget = parse_budget(opts.budget)
    device = _device(opts)
    splits = read_splits(opts.data)
    measuring = device.on_cpu and opts.mfu is None  # this machine, and no MFU stated: measured here
    plan, run = _plan_for(opts, budget, device, splits, check_data=not measuring)
    if not measuring:
        return {**plan, "throughput": {"source": "assumed", "mfu": device.mfu}}
    return _measured_plan(opts, budget, device, splits, run, on_measure)


def _plan_for(opts: PlanOptions, budget: Budget, device: Device, splits: DataSplits,
              check_data: bool = True) -> tuple[dict[str, Any], RunConfig]:
    slowdown, memory = 1.0, None
    for _ in range(4):  # the rung's slowdown changes the compute, which may change the model and its rung
        compute = _compute(budget, device, slowdown, opts, splits)
        model, seq_len = _model(compute, budget, device, splits, opts, slowdown)
        memory = _memory(model, seq_len, compute, device, opts)
        if math.isclose(memory.slowdown, slowdown):
            break
        slowdown = memory.slowdown
    return _finish(opts, budget, device, splits, compute, model, seq_len, memory, check_data)


def _measured_plan(opts: PlanOptions, budget: Budget, device: Device, splits: DataSplits, run: RunConfig,
                   on_measure: Callable[[str], None] | None) -> dict[str, Any]:
    """Plan again at the MFU measured for the planned step, until the plan's step is the one measured (the rate
    changes the compute, which may change the shape or the batch): at most MAX_PROBES measurements. Whether the
    dataset holds what the budget reads is judged at the measured rate only, so that a refusal's hint (a lower
    budget) is one that plans."""
    for attempt in range(1, MAX_PROBES + 1):
        if on_measure is not None:
            on_measure(f"measuring the planned step on this CPU ({run.model.num_hidden_layers} layers x "
                       f"{run.model.hidden_size}, micro-batch {run.train.micro_batch_size} x {run.seq_len}; at most "
                       f"{probe.MAX_S:g} s)")
        measured = probe.measure_cpu_step(run, device.flops_per_second)
        at = replace(device, mfu=measured.mfu(flops_per_token(run.model, run.seq_len), device.target.peak_flops))
        _, again = _plan_for(opts, budget, at, splits, check_data=False)
        same = _step_settings(again) == _step_settings(run)
        if same or attempt == MAX_PROBES:
            plan, again = _plan_for(opts, budget, at, splits)  # the data judged, at the measured rate
            return {**plan, "throughput": {"source": "measured", **probe.probe_record(measured, at.mfu),
                                           "of_this_shape": same, "measurements": attempt,
                                           "fingerprint": fingerprint(again, 1)}}
        run = again
    raise AssertionError("unreachable")


def _step_settings(run: RunConfig) -> tuple[Any, ...]:
    """What decides the MFU of a plan's step: the model and the sequence length. The batch follows the compute, so
    each measurement may move it by a sequence or two, which changes the rate far less than the measurement's own
    noise."""
    return run.model.to_dict(), run.seq_len


# ---------------------------------------------------------------------------------------------- budget to compute


def _device(opts: PlanOptions) -> Device:
    precision = run_precision(None, is_cpu(opts.gpu), has_bf16(opts.gpu))
    estimate_opts = EstimateOptions(gpu=opts.gpu, num_gpus=opts.num_gpus, price_per_hour=opts.price_per_hour)
    target = target_for(estimate_opts, precision)
    return Device(target, target.key, opts.num_gpus, precision, opts.mfu or DEFAULT_MFU)


def _steps_seconds(budget: Budget, device: Device, opts: PlanOptions, splits: DataSplits) -> float:
    """The training steps' share of a time or money budget: what is left after setup, less the reserved shares."""
    if budget.kind == "usd":
        price = device.target.usd_per_hour
        if not price:
            raise ConfigError(f"--budget {budget.text}: no price per hour for {device.target.name}",
                              "add --price-per-hour USD, or give the budget as time, e.g. --budget 10min")
        seconds = budget.amount / (price * device.num_gpus) * 3600
    else:
        seconds = budget.amount
    left = (seconds - device.setup_s) / (1 + RESERVED)
    if left <= 0:
        need = _budget_for(budget, device, _least_compute(opts, splits.vocab_size, device.num_gpus), 1.0)
        raise ConfigError(f"--budget {budget.text}: {budget.describe()} is less than the {device.setup_s:g} s a run "
                          f"takes to start on {device.target.name}", f"raise --budget to at least {need}")
    return left


def _compute(budget: Budget, device: Device, slowdown: float, opts: PlanOptions, splits: DataSplits) -> float:
    if budget.kind == "flops":
        return budget.amount
    return _steps_seconds(budget, device, opts, splits) * device.flops_per_second / slowdown


def _least_compute(opts: PlanOptions, vocab_size: int, gpus: int) -> float:
    """The least compute a plan can be made for: the one whose optimum is 1 / TOO_SMALL of the smallest shape (at
    the sequence length that compute would get)."""
    def at(seq_len: int) -> float:
        return 6 * CHINCHILLA_RATIO * (smallest_params(opts.family, vocab_size, seq_len) / TOO_SMALL) ** 2

    return at(seq_len_for(opts.family, rule.batch_tokens(at(MIN_SEQ_LEN)), gpus))


def _budget_for(budget: Budget, device: Device, compute: float, slowdown: float, up: bool = True) -> str:
    """The budget, in the unit given, that buys the steps `compute` FLOPs, rounded `up` (a budget to raise to) or
    down (one to lower to): what a refusal asks for."""
    if budget.kind == "flops":
        return budget.scaled(compute / budget.amount, up)
    seconds = device.setup_s + compute * slowdown / device.flops_per_second * (1 + RESERVED)
    if budget.kind == "usd":
        return budget.scaled(seconds / 3600 * device.num_gpus * device.target.usd_per_hour / budget.amount, up)
    return budget.scaled(seconds / budget.amount, up)


# ------------------------------------------------------------------------------------------------- the model


def _model(compute: float, budget: Budget, device: Device, splits: DataSplits, opts: PlanOptions,
           slowdown: float) -> tuple[ModelConfig, int]:
    """The shape and sequence length: the length from the rule's batch at the steps' FLOPs first, then again at the
    rule's own C of the shape that gives (its M counts less than nanopt's FLOPs per token: a smaller batch)."""
    seq_len = seq_len_for(opts.family, rule.batch_tokens(compute), device.num_gpus)
    model = _shape(compute, seq_len, budget, device, splits, opts, slowdown)
    again = seq_len_for(opts.family, rule_batch(model, seq_len, compute), device.num_gpus)
    if again == seq_len:
        return model, seq_len
    return _shape(compute, again, budget, device, splits, opts, slowdown), again


def rule_batch(model: ModelConfig, seq_len: int, compute: float) -> float:
    """The rule's batch for this shape trained on the tokens `compute` FLOPs buy it."""
    return rule.batch_tokens(rule.rule_compute(model, seq_len, compute / flops_per_token(model, seq_len)))


def _shape(compute: float, seq_len: int, budget: Budget, device: Device, splits: DataSplits, opts: PlanOptions,
           slowdown: float) -> ModelConfig:
    optimum = compute_optimal(compute, CHINCHILLA_RATIO)
    try:
        return choose_model(opts.family, splits.vocab_size, seq_len, optimum.params)
    except TooSmall as small:
        needed = 6 * CHINCHILLA_RATIO * (small.smallest_params / TOO_SMALL) ** 2
        shape = f"{small.smallest.num_hidden_layers} layers x {small.smallest.hidden_size}"
        raise ConfigError(
            f"--budget {budget.text}: buys a compute-optimal model of {optimum.params:,} parameters, under "
            f"1/{TOO_SMALL:g} of the smallest {opts.family} nanopt plans for a vocabulary of {splits.vocab_size:,} "
            f"({shape}: {small.smallest_params:,} parameters)",
            f"raise --budget to at least {_budget_for(budget, device, needed, slowdown)}") from None


def _memory(model: ModelConfig, seq_len: int, compute: float, device: Device, opts: PlanOptions) -> Memory:
    """The memory ladder's fastest rung that fits (on a CPU: DDP without checkpointing, in this machine's memory)
    and its largest micro-batch, for a batch near the rule's."""
    sequences = max(1, round(rule_batch(model, seq_len, compute) / (seq_len * device.num_gpus)))
    tokens = sequences * seq_len * device.num_gpus
    draft = _run(model, seq_len, sequences, tokens, tokens, device, opts, {})
    if device.on_cpu:
        memory = run_memory(draft, device.target, device.precision, 1)
        largest = memory.max_micro_batch(device.target.memory_bytes)
        if largest < 1:
            raise ConfigError(f"the planned model ({count_params(model).total:,} parameters) does not fit in this "
                              "machine's memory", "lower --budget, or plan for GPUs with --gpu")
        return Memory({"parallelism": "ddp", "activation_checkpointing": False, "optimizer": "adamw"},
                      "DDP", largest, 1.0)
    found = ladder(draft, device.target, device.precision, device.num_gpus, device.mfu)["recommended"]
    if found is None:
        raise ConfigError(f"the planned model ({count_params(model).total:,} parameters) fits no rung of the memory "
                          f"ladder on {device.num_gpus} x {device.target.name}",
                          "add GPUs with --num-gpus, or choose a card with more memory with --gpu")
    settings = {key: found[key] for key in ("parallelism", "activation_checkpointing", "optimizer")}
    return Memory(settings, found["name"], found["max_micro_batch"], float(found["slowdown"]))


def _run(model: ModelConfig, seq_len: int, micro: int, batch_tokens: int, train_tokens: int, device: Device,
         opts: PlanOptions, settings: dict[str, Any]) -> RunConfig:
    """A RunConfig of the plan so far (not written), for the memory model and the prediction to read."""
    data = os.path.relpath(os.path.abspath(opts.data), os.path.abspath(opts.out))
    config = TrainConfig(data=data, micro_batch_size=micro, global_batch_tokens=batch_tokens,
                         train_tokens=train_tokens, seq_len=seq_len, price_per_hour=opts.price_per_hour, **settings)
    return RunConfig(run_dir=Path(opts.out), model=model, train=config)


# --------------------------------------------------------------------------------------------- the whole plan


def _finish(opts: PlanOptions, budget: Budget, device: Device, splits: DataSplits, compute: float,
            model: ModelConfig, seq_len: int, memory: Memory, check_data: bool) -> tuple[dict[str, Any], RunConfig]:
    fpt = flops_per_token(model, seq_len)
    micro, global_tokens, steps = _batch(compute / fpt, model, seq_len, budget, device, compute, memory)
    train_tokens = steps * global_tokens
    least = _least_compute(opts, splits.vocab_size, device.num_gpus)

    def lowered(factor: float) -> str | None:  # no budget to lower to where even the smallest model needs more
        fits = compute * factor >= least
        return _budget_for(budget, device, compute * factor, memory.slowdown, up=False) if fits else None

    if check_data:
        check_epochs(splits, opts.data, train_tokens, opts.max_epochs, seq_len, lowered)
    tokens_per_s = device.flops_per_second / (fpt * memory.slowdown)
    eval_tokens = cadence.eval_tokens_for(train_tokens, seq_len, splits.val_tokens)
    run = _run(model, seq_len, micro, global_tokens, train_tokens, device, opts, memory.settings)
    timing = cadence.cadence_for(steps, global_tokens / tokens_per_s, eval_tokens,
                                 eval_seconds(eval_tokens, device.flops_per_second / fpt),
                                 checkpoint_seconds(run, device.num_gpus))
    run = replace(run, train=replace(
        run.train, learning_rate=rule.learning_rate(rule.rule_compute(model, seq_len, train_tokens)),
        min_lr_ratio=0.1, lr_schedule="cosine", warmup_steps=timing.warmup_steps, log_interval=timing.log_interval,
        eval_interval=timing.eval_interval, eval_tokens=timing.eval_tokens,
        checkpoint_interval=timing.checkpoint_interval, keep_checkpoints=cadence.KEEP_CHECKPOINTS))
    run.train.validate(model, "the planned train.json", look_up_data=False)
    prediction = predict(run, Hardware(device.gpu, device.num_gpus, opts.price_per_hour, device.mfu), "nanopt plan")
    return plan_record(opts, budget, device, splits, compute, run, memory, timing, prediction), run


def _batch(tokens: float, model: ModelConfig, seq_len: int, budget: Budget, device: Device, compute: float,
           memory: Memory) -> tuple[int, int, int]:
    """(micro-batch, global batch in tokens, optimizer steps): the rule's batch at the compute of `tokens`, in
    whole sequences a fitting micro-batch divides, and the whole steps `tokens` fill."""
    batch = rule.batch_tokens(rule.rule_compute(model, seq_len, tokens))
    micro, sequences = cadence.batch_for(batch, seq_len, device.num_gpus, memory.max_micro_batch)
    global_tokens = sequences * seq_len * device.num_gpus
    steps = math.floor(tokens / global_tokens)
    if steps < MIN_STEPS:  # steps grow as C^(0.5 - 0.3271): tokens as sqrt(C), the rule's batch as C^0.3271
        factor = (MIN_STEPS / max(steps, 1)) ** (1 / (0.5 - rule.BATCH_EXPONENT))
        need = _budget_for(budget, device, compute * factor, memory.slowdown)
        raise ConfigError(f"--budget {budget.text}: buys {steps} optimizer steps of the rule's batch "
                          f"({global_tokens:,} tokens), fewer than the {MIN_STEPS} a schedule needs",
                          f"raise --budget to at least {need}")
    return micro, global_tokens, steps
