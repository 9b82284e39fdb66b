"""preflight.json: what `nanopt preflight` measured and projected, and whether it still describes the run.

`nanopt estimate` reads it through this module (the measured throughput replaces its assumed MFU while the
fingerprint matches), and nanopt.plan.preflight writes it; this module imports neither, so the two do not import
each other.

preflight.json (`version` 1), one JSON object:

    key                        meaning
    version, time, unix_time   format version; when it was measured (ISO 8601 UTC, and Unix seconds)
    run                        the run directory
    device                     name (as CUDA or the OS reports it); kind (the GPU table key, "cpu", or null for a
                               GPU not in the table); world_size (ranks)
    precision, compile         as resolved on this device ("bf16" / "fp32"; true / false)
    micro_batch                size (measured); source ("train.json" or "find-batch"); train_json (the size
                               train.json has); advice ("set micro_batch_size N" when find-batch picked another)
    grad_accum                 micro-batches per optimizer step per rank
    steps                      warmup (run first, not measured: torch.compile's first step is among them) and
                               measured optimizer steps; seq_len, the sequence length they ran at (under
                               seq_len_stages the longest stage's, where they start; else train.json's)
    step_time_s                mean seconds of a measured optimizer step (the slowest rank)
    tokens_per_s               global_batch_tokens / step_time_s, over all ranks
    mfu, mfu_note,             MFU (nanopt.model.flops.mfu) against the device's dense peak; on a CPU against the
    peak_flops, peak_source    peak `nanopt estimate --gpu cpu` works out for this machine
    loader_wait_share          time inside the loader's next_batch over step time, measured steps, worst rank
    memory                     peak_bytes (the whole preflight); early_peak_bytes (after the first quarter of the
                               measured steps); end_peak_bytes; growth (end / early - 1); measure
    losses                     window; first_mean and last_mean (of the first and last `window` measured steps);
                               measured (every measured step's loss, null where not finite)
    eval_s, eval_first_s       one in-loop evaluation: a later one, and the first (which pays once, e.g. for
                               compiling the evaluation); null with eval_interval 0
    checkpoint_s               what one checkpoint save costs the steps: how long it blocks the step (copied to
                               host memory, then written in the background as training does, into a scratch
                               directory beside the run directory, waited for and removed afterwards), and on a
                               CPU also the background writer's CPU time, taken from the cores the steps use
    checkpoint_blocked_s       of checkpoint_s, the time the save blocks the step
    checkpoint_writer_cpu_s    of checkpoint_s, the writer's CPU time (0 on a GPU, whose steps the host's writing
                               does not slow)
    setup_s                    process start (as `nanopt train` bills it) to the first step, a find-batch search
                               excluded, plus the first step when compiled
    projection                 seconds per phase (setup, train, eval, checkpoint) for the whole run; total_s;
                               shares; the steps, evaluations and checkpoints counted; cost_usd per phase and
                               total_cost_usd (null without a price); price_per_hour, price_source, devices
    estimate                   what `nanopt estimate` assumes on this device: gpu, mfu, tokens_per_s,
                               train_seconds, cost_usd, ratio (measured / assumed tokens_per_s and
                               train_seconds); or a note saying why there is none
    checks, ok, failed         loss_falls, memory_flat, loader_wait_small, each {ok, detail}; whether all passed;
                               the names of those that did not
    fingerprint                the settings that decide speed: model (model.json), seq_len, micro_batch_size,
                               global_batch_tokens, precision, tf32, compile, activation_checkpointing, parallelism,
                               fp8, seq_len_stages (as train.json gives them), world_size. A run whose settings differ
                               makes the file stale: `nanopt estimate` then does not use it and says which setting
                               changed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import NanoptError
from nanopt.hardware import CPU
from nanopt.parsing import read_json
from nanopt.rundir import RunDir

FORMAT_VERSION = 1

# Settings that decide a step's speed: a preflight.json measured with others is stale.
SPEED_SETTINGS = ("seq_len", "micro_batch_size", "global_batch_tokens", "precision", "tf32", "compile",
                  "activation_checkpointing", "parallelism", "fp8", "seq_len_stages", "cuda_graphs",
                  "bf16_residual", "bf16_weight_copies")
# What a fingerprint written before a setting existed meant by leaving it out.
_BEFORE_THE_KEY = {"tf32": True, "fp8": "off", "seq_len_stages": None, "cuda_graphs": False, "bf16_residual": False,
                  "bf16_weight_copies": False}


def fingerprint(run: RunConfig, world_size: int) -> dict[str, Any]:
    """The settings that decide the speed of a step, as JSON would give them back."""
    train = run.train
    settings = {"model": run.model.to_dict(), "seq_len": run.seq_len, "micro_batch_size": train.micro_batch_size,
                "global_batch_tokens": train.global_batch_tokens, "precision": train.precision, "tf32": train.tf32,
                "compile": train.compile, "activation_checkpointing": train.activation_checkpointing,
                "parallelism": train.parallelism, "fp8": train.fp8, "seq_len_stages": train.seq_len_stages,
                "cuda_graphs": train.cuda_graphs, "bf16_residual": train.bf16_residual,
                "bf16_weight_copies": train.bf16_weight_copies,
                "world_size": world_size}
    return json.loads(json.dumps(settings))


def changed_setting(recorded: Any, current: dict[str, Any]) -> str | None:
    """The first setting that differs between a preflight's fingerprint and the run's now, said for a person
    ("micro_batch_size: 8 when measured, 4 now"); None when they match."""
    if not isinstance(recorded, dict):
        return "its fingerprint is missing"
    for key in ("model", *SPEED_SETTINGS, "world_size"):
        then, now = recorded.get(key, _BEFORE_THE_KEY.get(key)), current[key]
        if then == now:
            continue
        if key == "model":
            names = sorted(k for k in {*then, *now} if then.get(k) != now.get(k)) if isinstance(then, dict) else []
            return f"model.json {', '.join(names) or 'settings'} changed"
        return f"{key}: {json.dumps(then)} when measured, {json.dumps(now)} now"
    return None


def read_preflight(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the run's preflight.json, None), (None, None) when there is none, or (None, why it cannot be used, without
    the path): the fields `nanopt estimate` reads are checked, so a hand-edited or damaged file is a note, never a
    crash."""
    path = RunDir(run_dir).preflight_json
    if not path.is_file():
        return None, None
    try:
        data = read_json(path)
    except NanoptError as exc:
        return None, exc.message.removeprefix(f"{path}: ")
    problem = _unreadable_field(data)
    return (None, problem) if problem else (data, None)


def _unreadable_field(data: Any) -> str | None:
    from nanopt.hardware import GPUS

    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return f"not a version {FORMAT_VERSION} preflight.json"
    device, tokens_per_s = data.get("device"), data.get("tokens_per_s")
    if not (isinstance(tokens_per_s, (int, float)) and math.isfinite(tokens_per_s) and tokens_per_s > 0):
        return "no measured tokens_per_s"
    if not (isinstance(device, dict) and isinstance(device.get("name"), str)
            and (device.get("kind") is None or device.get("kind") in (CPU, *GPUS))
            and type(device.get("world_size")) is int and device["world_size"] >= 1):
        return "its device is not one nanopt describes"
    for key, kind in (("time", str), ("fingerprint", dict), ("steps", dict), ("projection", dict), ("failed", list)):
        if not isinstance(data.get(key), kind):
            return f"its {key!r} is missing or not a {kind.__name__}"
    return None

