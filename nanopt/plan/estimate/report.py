"""The estimate's report: the model, the token budget, time and cost, memory, the batch, the verdict and the
parallelism table, as one JSON-ready dict (keys documented in docs/cost-and-memory.md)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from nanopt.config import RunConfig
from nanopt.config.seq_stages import stage_tokens
from nanopt.cpu_threads import other_threads
from nanopt.errors import ConfigError
from nanopt.hardware import CPU, DEFAULT_GPU, is_cpu, resolve_gpu
from nanopt.model import flops
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.budget import plan_budget
from nanopt.plan.estimate.fit import fit
from nanopt.plan.estimate.ladder import compare_gpus, ladder
from nanopt.plan.estimate.layouts import parallelism
from nanopt.plan.estimate.options import DEFAULT_MFU, EstimateOptions
from nanopt.plan.estimate.target import Target, compiled, has_bf16, run_memory, run_precision, target_for
from nanopt.plan.planned_rate import SOURCE as PLANNED
from nanopt.plan.planned_rate import planned_mfu
from nanopt.plan.preflight_record import changed_setting, fingerprint, read_preflight
from nanopt.rundir import RunDir
from nanopt.train.shape_schedule import longest_stage_run, run_flops_per_token
from nanopt.untrusted_text import shell_word


def estimate(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (the keys are documented in docs/cost-and-memory.md)."""
    opts = opts.with_whole_counts()
    if run is None and opts.params is None and opts.flops is None:
        raise ConfigError("estimate needs a run directory or --params (or --flops)",
                          "e.g. `nanopt estimate runs/gpt2-small`, or `nanopt estimate --flops 1e21`")
    if opts.flops is not None:  # plan a model from a compute budget; a run directory gives only its family
        return plan_budget(run.model if run else None, _budget_options(run, opts))
    opts, measured, source = _throughput_source(run, opts)
    precision = run_precision(run, is_cpu(opts.gpu), has_bf16(opts.gpu))
    target = target_for(opts, precision)
    if run is not None:
        target = replace(target, peak_source=flops.fp8_peak_label(target.peak_source, run.train.fp8))
    report: dict[str, Any] = {"run": str(run.run_dir) if run else None}
    report.update(_model_section(run, opts))
    report.update(_budget_section(run, opts, report))
    report.update(_time_section(report, opts, target, measured))
    report["throughput_source"] = source
    report.update(_batch_section(run, opts))
    # Memory, the verdict and the layouts are judged at the longest sequence-length stage: the peak of the run.
    longest = longest_stage_run(run) if run is not None else None
    report.update(_memory_section(longest, opts, target, precision, report["params"]))
    mfu = report["gpu"]["mfu"] or DEFAULT_MFU
    report["fit"] = fit(longest, opts.num_gpus, target, precision, report["params"], mfu)
    report["parallelism"] = parallelism(longest, target, precision, opts.num_gpus, mfu)
    report["ladder"] = ladder(run, target, precision, opts.num_gpus, mfu)
    report["compare_gpus"] = _compared(run, opts, report)
    report["attention"] = _attention(run, target, precision)
    return report


def _budget_options(run: RunConfig | None, opts: EstimateOptions) -> EstimateOptions:
    """--flops plans another model than the run's: its preflight measured nothing about it, so the MFU is assumed."""
    price = opts.price_per_hour if opts.price_per_hour is not None else (run.train.price_per_hour if run else None)
    return replace(opts, gpu=opts.gpu or DEFAULT_GPU, num_gpus=opts.num_gpus or 1, mfu=opts.mfu or DEFAULT_MFU,
                   price_per_hour=price)


def _compared(run: RunConfig | None, opts: EstimateOptions, report: dict[str, Any]) -> dict[str, Any] | None:
    if not opts.compare_gpus:
        return None
    if run is None or is_cpu(opts.gpu):
        raise ConfigError("--compare-gpus needs a run directory and GPUs (not --params, not --gpu cpu)",
                          "e.g. `nanopt estimate runs/gpt2-small --compare-gpus --num-gpus 8`")
    # The table's price for each card: a --price-per-hour (or train.json's) is one card's, not every card's.
    return compare_gpus(run, replace(opts, price_per_hour=None), report["total_flops"], report["train_tokens"])


def _attention(run: RunConfig | None, target: Target, precision: str) -> dict[str, Any] | None:
    """The SDPA kernel a CUDA training step gets, and a warning when it is the slow, memory-hungry math fallback
    (the memory model counts its scores). None without a run or on a CPU, where SDPA's flash kernel takes all."""
    if run is None or target.is_cpu:
        return None
    return {"kernel": memory_model.attention_kernel(run.model, precision),
            "warning": memory_model.attention_fallback_warning(run.model, precision)}


def _throughput_source(run: RunConfig | None,
                       opts: EstimateOptions) -> tuple[EstimateOptions, float | None, dict[str, Any]]:
    """The options with what was left out taken from the run (its preflight's device and GPU count, train.json's
    price_per_hour), the measured tokens/s to use (None: assume the MFU), and where the throughput comes from."""
    found, problem = read_preflight(run.run_dir) if run is not None else (None, None)
    measured_on = found["device"] if found else {}
    gpu = opts.gpu if opts.gpu is not None else (measured_on.get("kind") or DEFAULT_GPU)
    key = CPU if is_cpu(gpu) else resolve_gpu(gpu)[0].key
    world = measured_on.get("world_size")
    same_device = found is not None and measured_on["kind"] == key
    num_gpus = opts.num_gpus if opts.num_gpus is not None else (world if same_device and key != CPU else 1)
    price = opts.price_per_hour if opts.price_per_hour is not None else (run.train.price_per_hour if run else None)
    opts = replace(opts, gpu=gpu, num_gpus=num_gpus, price_per_hour=price)
    if opts.mfu is not None:  # asked for explicitly: the person's assumption wins over any measurement
        return opts, None, {"kind": "assumed", "mfu": opts.mfu, "note": None}
    note = _unusable(run, found, problem, key, num_gpus, opts.cpu_threads) if run is not None else None
    if found is None or note is not None:
        planned = planned_mfu(run, key, num_gpus, opts.cpu_threads) if run is not None else None
        if planned is not None:  # a CPU plan's own measurement, the run still as planned
            mfu, path = planned
            note = note and f"{note}; throughput from {path}'s own measurement (MFU {mfu:.1%})"
            return replace(opts, mfu=mfu), None, {"kind": PLANNED, "mfu": mfu, "path": path, "note": note}
        note = note and f"{note}; throughput assumed at MFU {DEFAULT_MFU:g}"
        return replace(opts, mfu=DEFAULT_MFU), None, {"kind": "assumed", "mfu": DEFAULT_MFU, "note": note}
    projection = found["projection"]
    outdated = _projection_outdated(run, projection)  # the speed still holds; the whole-run total does not
    return opts, float(found["tokens_per_s"]), {
        "kind": "preflight", "path": str(RunDir(run.run_dir).preflight_json), "device": measured_on["name"],
        "gpu": key, "world_size": world, "measured_at": found["time"], "steps": _number(found["steps"].get("measured")),
        "tokens_per_s": found["tokens_per_s"], "mfu": _number(found.get("mfu")),
        "projected_total_seconds": None if outdated else _number(projection.get("total_s")),
        "projected_cost_usd": None if outdated else _number(projection.get("total_cost_usd")),
        "projection_outdated": outdated, "failed_checks": found["failed"], "note": None}


def _projection_outdated(run: RunConfig, projection: dict[str, Any]) -> str | None:
    """Why preflight's whole-run projection no longer describes the run (the budget or the evaluation or checkpoint
    cadence changed since: they are not speed settings, so its tokens/s still stands), or None."""
    from nanopt.train.observe.phases import occasions

    now = {"steps": run.total_steps,
           "evaluations": occasions(run.train.eval_interval, 0, run.total_steps) if run.train.eval_interval else 0,
           "checkpoints": occasions(run.train.checkpoint_interval, 0, run.total_steps)}
    for name, count in now.items():
        if projection.get(name) != count:
            return (f"it projected {projection.get(name)} {name}, the run now has {count}: run `nanopt preflight "
                    f"{shell_word(run.run_dir)}` again for the whole-run projection")
    return None


def _number(value: Any) -> float | None:
    """A number preflight.json gives, or None for one that is missing or not a finite number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _unusable(run: RunConfig, found: dict[str, Any] | None, problem: str | None, key: str,
              num_gpus: int, cpu_threads: int | None) -> str | None:
    """Why the run's preflight.json cannot stand for this estimate's throughput, as one note; None if it can (or
    there is none). On a CPU the measurement's torch threads must be the run's (`cpu_threads`, when known): other
    work that kept a core busy during the preflight and not during training (or the other way) changes the rate
    far more than any setting."""
    path = RunDir(run.run_dir).preflight_json
    if problem is not None:
        return f"{path} not used: {problem}"
    if found is None:
        return None
    device = found["device"]
    if device["kind"] != key or device["world_size"] != num_gpus:
        return (f"{path} was measured on {device['world_size']} x {device['name']}, not on this estimate's "
                f"{num_gpus} x {key}")
    changed = changed_setting(found["fingerprint"], fingerprint(run, num_gpus))
    if changed is not None:
        return (f"{path} is stale ({changed}): run `nanopt preflight {shell_word(run.run_dir)}` again to measure the "
                "run as it is")
    measured_with = other_threads(device.get("cpu_threads"), cpu_threads)
    if key == CPU and measured_with is not None:
        return (f"{path} was measured with {_threads(measured_with)}, this run trains with {_threads(cpu_threads)} "
                "(other work kept a different number of cores busy then)")
    return None


def _threads(count: int) -> str:
    return f"{count} CPU thread{'s' if count != 1 else ''}"


def _model_section(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    if run is None:
        return {"params": opts.params, "non_embedding_params": None, "seq_len": None,
                "flops_per_token": 6 * opts.params, "flops_per_token_6n": 6 * opts.params,
                "flops_formula": "6N (no architecture given, so no attention term)"}
    count = flops.count_params(run.model)
    return {"params": count.total, "non_embedding_params": count.non_embedding, "seq_len": run.seq_len,
            "flops_per_token": run_flops_per_token(run), "flops_per_token_6n": flops.flops_per_token_6n(run.model),
            "flops_formula": "PaLM: 6 x (non-embedding params + output head) + 12 x layers x hidden x seq_len" +
                             ("; seq_len stages weighted by their tokens" if len(run.seq_stages) > 1 else "")}


def _budget_section(run: RunConfig | None, opts: EstimateOptions, report: dict[str, Any]) -> dict[str, Any]:
    optimal = flops.chinchilla_tokens(report["params"], opts.tokens_per_param)
    train_tokens = run.total_tokens if run else (opts.tokens or optimal)
    return {"chinchilla_tokens_per_param": opts.tokens_per_param, "chinchilla_tokens": optimal,
            "train_tokens": train_tokens, "train_tokens_vs_chinchilla": train_tokens / optimal}


def _time_section(report: dict[str, Any], opts: EstimateOptions, target: Target,
                  measured_tokens_per_s: float | None) -> dict[str, Any]:
    """Time and cost at the assumed MFU, or at a preflight's measured tokens/s (its MFU then against this target's
    peak, through the one MFU function)."""
    total_flops = report["train_tokens"] * report["flops_per_token"]
    if measured_tokens_per_s is None:
        seconds = flops.train_seconds(total_flops, opts.num_gpus, target.peak_flops, opts.mfu)
        utilization = opts.mfu
    else:
        seconds = report["train_tokens"] / measured_tokens_per_s
        utilization = flops.mfu(measured_tokens_per_s, report["flops_per_token"], opts.num_gpus, target.peak_flops)
    tokens_per_second = report["train_tokens"] / seconds
    section: dict[str, Any] = {
        "total_flops": total_flops, "train_seconds": seconds, "train_hours": seconds / 3600,
        "cost_usd": _cost(seconds / 3600, opts.num_gpus, target.usd_per_hour),
        "tokens_per_second": tokens_per_second,
        "gpu": {"key": target.key, "name": target.name, "peak_tflops": target.peak_flops / 1e12,
                "peak_source": target.peak_source, "usd_per_hour": target.usd_per_hour, "num_gpus": opts.num_gpus,
                "mfu": utilization, "note": target.note},
        "hours": None,
    }
    if opts.hours:
        tokens = (flops.tokens_in_seconds(opts.hours * 3600, report["flops_per_token"], opts.num_gpus,
                                          target.peak_flops, opts.mfu) if measured_tokens_per_s is None
                  else int(opts.hours * 3600 * measured_tokens_per_s))
        section["hours"] = {"hours": opts.hours, "tokens": tokens,
                            "fraction_of_chinchilla": tokens / report["chinchilla_tokens"],
                            "cost_usd": _cost(opts.hours, opts.num_gpus, target.usd_per_hour)}
    return section


def _cost(hours: float, devices: int, usd_per_hour: float | None) -> float | None:
    return None if usd_per_hour is None else hours * devices * usd_per_hour


def _memory_section(run: RunConfig | None, opts: EstimateOptions, target: Target, precision: str,
                    params: int) -> dict[str, Any]:
    if run is None:
        states = memory_model.states_only(params)
        return {"memory_bytes": {**states.to_dict(0), "activations_per_sequence": None},
                "gpu_memory_bytes": target.memory_bytes, "max_micro_batch": None, "memory_assumptions": None}
    memory = run_memory(run, target, precision, opts.num_gpus)
    return {"memory_bytes": memory.to_dict(run.train.micro_batch_size), "gpu_memory_bytes": target.memory_bytes,
            "max_micro_batch": memory.max_micro_batch(target.memory_bytes),
            "memory_assumptions": {"precision": precision, "compile": compiled(run, target),
                                   "activation_checkpointing": run.train.activation_checkpointing,
                                   "parallelism": run.train.parallelism, "world_size": opts.num_gpus,
                                   "micro_batch_size": run.train.micro_batch_size, "seq_len": run.seq_len}}


def _batch_section(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    if run is None:
        return {"optimizer_steps": None, "grad_accum": None, "global_batch_tokens": None, "batch_warmup": None,
                "seq_len_stages": None}
    try:
        accum: Any = run.grad_accum_steps(opts.num_gpus)
    except ConfigError as exc:  # an estimate still helps; the error text says which numbers would work
        accum = f"inexact: {exc.one_line()}"
    ramp = run.train.batch_ramp
    warmup = None if ramp is None else {"start_tokens": ramp.start_tokens, "tokens": ramp.levels[-1].tokens_before,
                                        "steps": ramp.ramp_steps}
    return {"optimizer_steps": run.total_steps, "grad_accum": accum, "batch_warmup": warmup,
            "seq_len_stages": _stages(run),
            "global_batch_tokens": run.train.global_batch_tokens, "micro_batch_size": run.train.micro_batch_size}


def _stages(run: RunConfig) -> list[dict[str, int]] | None:
    """Each sequence-length stage: its first step (1-based, as the logs count), seq_len, micro-batch and tokens."""
    stages = run.seq_stages
    if len(stages) == 1:
        return None
    tokens = stage_tokens(stages, run.total_steps, run.train.global_batch_tokens)
    return [{"first_step": stage.first_step + 1, "seq_len": stage.seq_len, "micro_batch_size": stage.micro_batch_size,
             "tokens": count} for stage, count in zip(stages, tokens, strict=True)]
