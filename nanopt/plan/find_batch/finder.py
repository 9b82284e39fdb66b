"""`find_batch`: the whole search over trials, its report, find_batch.json, and `--write` into train.json."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanopt import errors
from nanopt.config import RunConfig, TrainConfig
from nanopt.errors import ConfigError, NanoptError
from nanopt.files import check_run_dir
from nanopt.model.flops import flops_per_token, mfu, mfu_note
from nanopt.parsing import from_dict, read_json, save_json
from nanopt.plan.find_batch.calibration import calibrate, predict_micro_batch
from nanopt.plan.find_batch.search import (
    PREDICTED_GROWTH,
    FindBatchOptions,
    Trial,
    grad_accum_for,
    judge,
    memory_limit,
    search_among,
    trials_in_process,
    usable_bytes,
    usable_micro_batches,
)
from nanopt.plan.find_batch.trials import InProcessTrials, ProcessTrials
from nanopt.rundir import RunDir
from nanopt.runtime import ranks

# ---------------------------------------------------------------------------------------------- find_batch


def find_batch(run: RunConfig, opts: FindBatchOptions, on_start: Callable[[int], None] | None = None,
               on_trial: Callable[[Trial], None] | None = None) -> dict[str, Any]:
    """Search the micro-batch sizes, save runs/NAME/find_batch.json (rank 0) and return the report (every rank)."""
    opts.validate()
    check_run_dir(run.run_dir)  # find_batch.json is written there at the end: a link there is refused now
    started = time.monotonic()
    world = ranks().world_size
    if world > 1:
        report = _in_process(run, opts, world, "ranks", on_start, on_trial)
    else:
        if _surely_no_gpu():
            _check_device(opts, on_cuda=False)  # a missing --max-memory fails now, before any server starts
            device = _cpu_facts(run)
        else:
            device = ProcessTrials(run, opts).device_facts()
        _check_device(opts, device["cuda"])
        if trials_in_process(opts.isolation, device["cuda"], device["compiled"]):
            report = _in_process(run, opts, world, "in-process", on_start, on_trial)
        else:
            report = _search(run, opts, ProcessTrials(run, opts), world, device, "process", on_start, on_trial)
    report["seconds"] = time.monotonic() - started
    if ranks().is_main:
        path = RunDir(run.run_dir).find_batch_json
        save_json(path, report)
        report["saved"] = str(path)
    return report


def _in_process(run: RunConfig, opts: FindBatchOptions, world: int, isolation: str,
                on_start: Callable[[int], None] | None, on_trial: Callable[[Trial], None] | None) -> dict[str, Any]:
    """The search with every trial in this process (and, under torchrun, in every rank's process)."""
    from nanopt.runtime import init_runtime, shutdown
    from nanopt.train.parallel.wrap import resolve_compile

    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    try:
        _check_device(opts, rt.device.type == "cuda")
        trials = InProcessTrials(run, opts, rt)
        device = {"cuda": rt.device.type == "cuda", "device_memory_bytes": trials.probe.device_memory_bytes,
                  "precision": rt.precision, "compiled": resolve_compile(run.train.compile, rt.device)}
        return _search(run, opts, trials, world, device, isolation, on_start, on_trial)
    finally:
        shutdown(rt)


def _cpu_facts(run: RunConfig) -> dict[str, Any]:
    """What the memory model needs to know of this machine when it has no GPU (asked without a trial process)."""
    import torch

    from nanopt.runtime import resolve_precision
    from nanopt.train.parallel.wrap import resolve_compile

    cpu = torch.device("cpu")
    return {"cuda": False, "device_memory_bytes": None, "precision": resolve_precision(run.train.precision, cpu),
            "compiled": resolve_compile(run.train.compile, cpu)}


def _surely_no_gpu() -> bool:
    """True when this Linux or macOS machine has no GPU device node at all, so CUDA cannot be available."""
    import sys

    if sys.platform == "darwin":
        return True
    if not sys.platform.startswith("linux"):
        return False
    dev = Path("/dev")
    return not any(dev.glob("nvidia[0-9]*")) and not (dev / "kfd").exists()


def _check_device(opts: FindBatchOptions, on_cuda: bool) -> None:
    if on_cuda and opts.max_memory is not None:
        raise ConfigError("--max-memory bounds CPU trials; this machine has a CUDA GPU",
                          "use --gpu-memory (e.g. --gpu-memory 40GiB) to ask what fits on a smaller card")
    if not on_cuda and opts.gpu_memory is not None:
        raise ConfigError("--gpu-memory: no CUDA GPU here", "on the CPU bound each trial with --max-memory, "
                                                           "e.g. --max-memory 4GiB")
    if not on_cuda and opts.max_memory is None:
        raise ConfigError("on the CPU nothing runs out of memory, so nothing would stop the search",
                          "pass --max-memory, e.g. --max-memory 4GiB: the peak resident memory a trial process "
                          "may reach (Python and torch included)")


def _search(run: RunConfig, opts: FindBatchOptions, runner: Callable[[int], dict[str, Any]], world: int,
            device: dict[str, Any], isolation: str, on_start: Callable[[int], None] | None,
            on_trial: Callable[[Trial], None] | None) -> dict[str, Any]:
    # Only sizes the run can use are tried: one that does not divide the global batch could not be trained with.
    sizes = usable_micro_batches(run.train, run.seq_len, world, opts.maximum)
    trials: dict[int, Trial] = {}
    facts: dict[str, Any] = {}
    usable = usable_bytes(memory_limit(opts, device["device_memory_bytes"]), opts.margin)
    # On the CPU a trial's peak includes Python and torch; this process, which imported both, stands in for them.
    baseline = None if device["cuda"] else _resident_bytes()
    predicted = predict_micro_batch(run, world, device["precision"], device["compiled"], usable, baseline)
    start, growth = opts.start, 2.0
    if start is None:  # near the answer already: small steps from there
        start, growth = min(max(1, predicted or 1), opts.maximum), PREDICTED_GROWTH

    def fits(size: int) -> bool:
        if on_start:
            on_start(size)
        m = runner(size)
        if m["status"] == "user_error":
            raise getattr(errors, m["kind"], NanoptError)(m["message"], m["hint"])
        if "device" in m:
            facts.update({k: m[k] for k in _FACT_KEYS if k in m})
            facts.setdefault("baseline_bytes", m.get("baseline_bytes"))
        trial = _trial(run, world, size, m, facts, opts)
        trials[size] = trial
        if on_trial:
            on_trial(trial)
        return trial.fits

    max_fit, order = search_among(fits, sizes, start, max_trials=opts.max_trials, growth=growth)
    report = _report(run, opts, world, max_fit, order, trials, facts, capped=max_fit == sizes[-1])
    report.update(_search_facts(opts, max_fit, trials, sizes, predicted, order[0], isolation))
    return report


def _search_facts(opts: FindBatchOptions, max_fit: int, trials: dict[int, Trial], sizes: list[int],
                  predicted: int | None, start: int, isolation: str) -> dict[str, Any]:
    """How the search went: where it started and why, and whether it closed in on its answer."""
    # Complete: the next usable size up failed (or there is none); otherwise --max-trials ended the search first.
    above = [size for size in sizes if size > max_fit]
    complete = not above or (above[0] in trials and not trials[above[0]].fits)
    return {"micro_batch": max_fit, "predicted_micro_batch": predicted, "search_start": start,
            "usable_micro_batches": sizes,
            "search_start_source": "--start" if opts.start is not None else "memory model",
            "search_complete": complete, "max_trials": opts.max_trials, "isolation": isolation}


def _resident_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


_FACT_KEYS = ("device", "device_name", "device_memory_bytes", "context_bytes", "precision", "compiled", "peak_flops",
              "peak_source")


def _trial(run: RunConfig, world: int, size: int, m: dict[str, Any], facts: dict[str, Any],
           opts: FindBatchOptions) -> Trial:
    fits, reason = judge(m, memory_limit(opts, facts.get("device_memory_bytes")), opts.margin)
    if "agreed_fits" in m and m["agreed_fits"] != fits:
        fits, reason = m["agreed_fits"], "fits" if m["agreed_fits"] else "does not fit on another rank"
    times = m.get("step_times_s") or []
    timed = times[1:] if len(times) > 1 else times  # the first step allocates the optimizer state (and compiles)
    # The fastest timed step: other work on the machine only ever slows a step down, so the minimum is the
    # steadiest estimate for comparing sizes.
    step_time = min(timed) if timed and m["status"] == "ok" else None
    tokens_per_s = size * run.seq_len * world / step_time if step_time else None
    peak_flops = facts.get("peak_flops")
    utilization = mfu(tokens_per_s, flops_per_token(run.model, run.seq_len), world, peak_flops) if tokens_per_s \
        else None
    return Trial(micro_batch_size=size, fits=fits, reason=reason, peak_memory_bytes=m.get("peak_memory_bytes"),
                 tokens_per_s=tokens_per_s, mfu=utilization, step_time_s=step_time,
                 mfu_note=mfu_note(utilization, peak_flops) if tokens_per_s else None,
                 grad_accum=grad_accum_for(run.train, size, run.seq_len, world),
                 peak_is_lower_bound=bool(m.get("peak_is_lower_bound")))


# -------------------------------------------------------------------------------------------------- report


def _report(run: RunConfig, opts: FindBatchOptions, world: int, max_fit: int, order: list[int],
            trials: dict[int, Trial], facts: dict[str, Any], capped: bool) -> dict[str, Any]:
    limit = memory_limit(opts, facts.get("device_memory_bytes"))
    fitting = [t for t in trials.values() if t.fits]
    exact = [t for t in fitting if t.grad_accum is not None]
    best = max(exact or fitting, key=lambda t: (t.tokens_per_s or 0.0, t.micro_batch_size), default=None)
    max_exact = max((t.micro_batch_size for t in exact), default=None)
    calibration = calibrate(run, world, facts, trials, usable_bytes(limit, opts.margin), max_fit, capped=capped)
    configured = run.train.micro_batch_size
    return {
        "run": str(run.run_dir), "device": facts.get("device"), "device_name": facts.get("device_name"),
        "world_size": world, "precision": facts.get("precision"), "compiled": facts.get("compiled"),
        "activation_checkpointing": run.train.activation_checkpointing, "parallelism": run.train.parallelism,
        "seq_len": run.seq_len, "steps_per_trial": opts.steps,
        "limit": {"kind": "gpu" if facts.get("device") == "cuda" else "cpu_peak_rss", "bytes": limit,
                  "margin": opts.margin, "usable_bytes": usable_bytes(limit, opts.margin),
                  "gpu_memory_cap": opts.gpu_memory, "context_bytes": facts.get("context_bytes"),
                  "baseline_bytes": facts.get("baseline_bytes")},
        "max_micro_batch": max_fit,
        "max_micro_batch_capped": capped,  # every usable size up to --max fit: the true max may be higher
        "best_micro_batch": best.micro_batch_size if best else None,
        "max_exact_micro_batch": max_exact,
        "global_batch_tokens": run.train.global_batch_tokens,
        "grad_accum_at_max": trials[max_fit].grad_accum if max_fit else None,
        "grad_accum_at_best": best.grad_accum if best else None,
        "configured": {"micro_batch_size": configured,
                       "grad_accum": grad_accum_for(run.train, configured, run.seq_len, world),
                       "fits": trials[configured].fits if configured in trials else None},
        "peak_flops": facts.get("peak_flops"), "peak_source": facts.get("peak_source"),
        "search_order": order,
        "trials": [dataclasses.asdict(trials[size]) for size in sorted(trials)],
        "predicted_max_micro_batch": calibration["predicted_max_micro_batch"],
        "calibration": calibration,
    }


# ------------------------------------------------------------------------------------------------- --write


def write_micro_batch(run_dir: Path, report: dict[str, Any], pick: str) -> dict[str, Any]:
    """Set train.json's micro_batch_size to the best (fastest) or the largest size that fits with an exact
    accumulation; other keys, their order and values are kept. Returns {path, old, new}."""
    new = report["best_micro_batch"] if pick == "best" else report["max_exact_micro_batch"]
    if new is None or (pick == "best" and report["grad_accum_at_best"] is None):
        raise ConfigError(f"--write: no micro-batch that fits divides the global batch of "
                          f"{report['global_batch_tokens']:,} tokens exactly",
                          "change global_batch_tokens to a multiple of micro_batch_size x seq_len x world size, "
                          "see the table")
    path = RunDir(run_dir).train_json
    raw = read_json(path)
    old = raw.get("micro_batch_size")
    updated = {**raw, "micro_batch_size": new}  # same key order: the key exists (it is required)
    _check_still_valid(path, run_dir, updated, report["world_size"])
    save_json(path, updated)
    return {"path": str(path), "old": old, "new": new}


def _check_still_valid(path: Path, run_dir: Path, raw: dict[str, Any], world: int) -> None:
    from nanopt.config import load_model_config

    model = load_model_config(RunDir(run_dir).model_json)
    train = from_dict(TrainConfig, raw, f"{path} (after --write)")
    train.validate(model, f"{path} (after --write)")
    RunConfig(run_dir=Path(run_dir), model=model, train=train).grad_accum_steps(world)

