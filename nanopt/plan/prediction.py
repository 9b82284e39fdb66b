"""What a run is predicted to take before its first step: tokens/s, step time, peak memory per GPU, the time of
each phase, the whole run's time and its cost. `nanopt plan` predicts the run it writes; `nanopt train` writes the
prediction of a run that starts from step 0 into RUN/prediction.json, for the device it trains on, so that the end
of each session and `nanopt eval RUN` can put what was measured beside it (nanopt.train.observe.prediction reads it
back).

Throughput is `nanopt estimate`'s: a preflight.json measured with the run's settings on this device, else an
assumed MFU of the device's dense peak, slowed by the run's rung of the memory ladder (activation checkpointing,
sharding: nanopt.plan.estimate.ladder). The other phases are modelled from stated assumptions (below), or taken
from the preflight that measured them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from nanopt.config import RunConfig
from nanopt.hardware import CPU, is_cpu
from nanopt.model.flops import count_params
from nanopt.parsing import save_json
from nanopt.plan.estimate import EstimateOptions, estimate
from nanopt.plan.estimate.ladder import Rung
from nanopt.plan.preflight_record import read_preflight
from nanopt.rundir import RunDir
from nanopt.train.observe.phases import occasions

FORMAT_VERSION = 1
# Setup: imports, the dataset's checks, building the model (about 6 s on a 2-core CPU for runs/demo); on a GPU
# also the CUDA context and NCCL, and torch.compile's first step when compiled.
SETUP_S = {"cpu": 10.0, "gpu": 60.0}
COMPILE_S = 60.0
# A checkpoint blocks the step while the weights and the optimizer's state are copied for the background writer:
# a fixed cost, and bytes at host-copy speed. runs/demo's 0.9M parameters blocked 72 ms on a CPU.
CHECKPOINT_FIXED_S = 0.05
CHECKPOINT_BYTES_PER_S = 2e9
STATE_BYTES_PER_PARAM = {"adamw": 12, "adamw8bit": 6, "muon": 8}  # fp32 weights and the optimizer's moments
# Log lines, metrics records, the loss chart: 0.7% of runs/demo's time.
OTHER_SHARE = 0.01
ASSUMPTIONS = (f"setup {SETUP_S['cpu']:g} s on a CPU, {SETUP_S['gpu']:g} s on GPUs (+{COMPILE_S:g} s compiling); "
               "an evaluation runs forward only (a third of a step's FLOPs per token) at the training rate; a "
               f"checkpoint blocks {CHECKPOINT_FIXED_S:g} s + its state at {CHECKPOINT_BYTES_PER_S / 1e9:g} GB/s; "
               f"other time {OTHER_SHARE:.0%} of the steps'")


@dataclass(frozen=True)
class Hardware:
    """Where the run is predicted to train: a GPU table key (or "cpu"), how many, at what price per device-hour."""

    gpu: str
    num_gpus: int = 1
    price_per_hour: float | None = None
    mfu: float | None = None  # None: a matching preflight's throughput, else estimate's default MFU
    cpu_threads: int | None = None  # on a CPU, the torch threads the run trains with; None: not known


def predict(run: RunConfig, hardware: Hardware, made_by: str) -> dict[str, Any]:
    """The prediction for `run` on `hardware`, JSON-ready (see the module docstring)."""
    gpus = 1 if is_cpu(hardware.gpu) else hardware.num_gpus  # a CPU's ranks share the one machine
    report = estimate(run, EstimateOptions(gpu=hardware.gpu, num_gpus=gpus, mfu=hardware.mfu,
                                           price_per_hour=hardware.price_per_hour, cpu_threads=hardware.cpu_threads))
    source, measured = report["throughput_source"], _preflight_phases(run, report)
    slowdown = 1.0 if source["kind"] == "preflight" else _slowdown(run, report)
    tokens_per_s = report["tokens_per_second"] / slowdown
    step_s = run.train.global_batch_tokens / tokens_per_s
    evals = occasions(run.train.eval_interval, 0, run.total_steps) if run.train.eval_interval else 0
    checkpoints = occasions(run.train.checkpoint_interval, 0, run.total_steps)
    eval_one = measured.get("eval_s") or eval_seconds(run.train.eval_tokens, report["tokens_per_second"])
    checkpoint_one = measured.get("checkpoint_s") or checkpoint_seconds(run, gpus)
    train_s = run.total_tokens / tokens_per_s
    on_cpu = report["gpu"]["key"] == CPU
    setup = measured.get("setup_s") or setup_seconds(on_cpu, bool((report["memory_assumptions"] or {}).get("compile")))
    seconds = {"setup": setup, "train": train_s,
               "eval": evals * eval_one, "checkpoint": checkpoints * checkpoint_one, "other": OTHER_SHARE * train_s}
    total = sum(seconds.values())
    price = report["gpu"]["usd_per_hour"]
    return {
        "version": FORMAT_VERSION, "made_by": made_by,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"kind": report["gpu"]["key"], "name": report["gpu"]["name"], "num_gpus": gpus,
                   "precision": (report["memory_assumptions"] or {}).get("precision"),
                   "cpu_threads": hardware.cpu_threads if on_cpu else None},
        "throughput": {"source": source["kind"], "mfu": report["gpu"]["mfu"], "slowdown": slowdown,
                       "note": source.get("note")},
        "tokens_per_s": tokens_per_s, "step_s": step_s, "micro_batch_size": run.train.micro_batch_size,
        "peak_memory_bytes": report["memory_bytes"]["total"], "steps": run.total_steps, "tokens": run.total_tokens,
        "evaluations": evals, "checkpoints": checkpoints, "eval_s": eval_one, "checkpoint_s": checkpoint_one,
        "seconds": seconds, "total_s": total, "price_per_hour": price,
        "cost_usd": None if price is None else total / 3600 * gpus * price,
        "assumptions": ASSUMPTIONS, "settings_sha256": settings_digest(run),
    }


def eval_seconds(eval_tokens: int, tokens_per_s: float) -> float:
    """One in-loop evaluation: forward only, a third of a training step's FLOPs per token, at the same rate."""
    return eval_tokens / (3 * tokens_per_s)


def checkpoint_seconds(run: RunConfig, gpus: int) -> float:
    """How long one save blocks the step; a sharded layout copies each rank's share in parallel."""
    state = count_params(run.model).total * STATE_BYTES_PER_PARAM[run.train.optimizer]
    sharded = run.train.parallelism != "ddp" and gpus > 1
    return CHECKPOINT_FIXED_S + state / (gpus if sharded else 1) / CHECKPOINT_BYTES_PER_S


def setup_seconds(on_cpu: bool, compiled: bool) -> float:
    return SETUP_S["cpu" if on_cpu else "gpu"] + (COMPILE_S if compiled else 0.0)


def settings_digest(run: RunConfig) -> str:
    """The run's model.json and train.json as loaded: a prediction made for other settings is not this run's."""
    return hashlib.sha256(json.dumps(run.snapshot(), sort_keys=True).encode()).hexdigest()


def _slowdown(run: RunConfig, report: dict[str, Any]) -> float:
    """The run's own rung of the memory ladder against plain DDP: its recomputation, communication and CPU
    offload (the ladder's row where there is one), none of which an assumed MFU counts."""
    rung = Rung(run.train.parallelism, run.train.activation_checkpointing, run.train.optimizer)
    for row in (report.get("ladder") or {}).get("rows", []):
        if (row["parallelism"], row["activation_checkpointing"], row["optimizer"]) == (
                rung.parallelism, rung.checkpointing, rung.optimizer):
            return float(row["slowdown"])
    return rung.slowdown()


def _preflight_phases(run: RunConfig, report: dict[str, Any]) -> dict[str, float]:
    """What a preflight the estimate used measured of the other phases (setup, one evaluation, one checkpoint)."""
    if report["throughput_source"]["kind"] != "preflight":
        return {}
    found, _ = read_preflight(run.run_dir)
    return {key: float(value) for key, value in (found or {}).items()
            if key in ("setup_s", "eval_s", "checkpoint_s") and _positive(value)}


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# ----------------------------------------------------------------------------------- recorded before the first step


def record_prediction(run: RunConfig, world_size: int) -> dict[str, Any] | None:
    """Before the first step of a run, its prediction on the device this process trains on, written to
    RUN/prediction.json (replacing one made for an earlier start at step 0: `--resume none`, or `nanopt plan`'s
    device); None, writing nothing, on a GPU the table does not know (no peak, so nothing to predict from)."""
    import torch

    gpu = training_device()
    if gpu is None:
        return None
    threads = torch.get_num_threads() if gpu == CPU else None  # as this process chose them (nanopt.cpu_threads)
    prediction = predict(run, Hardware(gpu, world_size, run.train.price_per_hour, cpu_threads=threads),
                         "nanopt train")
    save_json(RunDir(run.run_dir).prediction_json, prediction)
    return prediction


def training_device() -> str | None:
    """The GPU table key of the GPU training will use ("cpu" without CUDA), or None for a GPU not in the table."""
    import torch

    from nanopt.hardware import detect_gpu

    if not torch.cuda.is_available():
        return CPU
    found = detect_gpu(torch.cuda.get_device_name(torch.cuda.current_device()))
    return None if found is None else found.key
