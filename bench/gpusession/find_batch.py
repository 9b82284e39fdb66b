"""`nanopt find-batch` on GPT-2 small: the eager search (its trials in one process: the 2-minute target) against
`nanopt estimate`'s prediction for this card's memory, then one compiled trial timed, and what the default
compiled search (a fresh process and a cold compilation per trial) would cost at that rate; and that default
search itself, as a person on a GPU runs it (step find-batch-compiled).
"""

from __future__ import annotations

import json
import shlex
import time
from typing import Any

from gpusession.isolation import graph_state, run_nanopt
from gpusession.presets import gpt2_micro, preset
from gpusession.records import Context, append_record, base_record, gib, read_records

TARGET_S = 120.0  # find-batch answers within 2 minutes (bench/RESULTS.md's targets)


def _device_bytes() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _timed(args: list[str]) -> tuple[int, dict[str, Any] | None, float]:
    start = time.perf_counter()
    code, stdout = run_nanopt(*args)
    seconds = time.perf_counter() - start
    found = None
    if code == 0:
        try:
            found = json.loads(stdout)
        except json.JSONDecodeError:
            code = -1
    return code, found, seconds


def _shown(args: list[str], run: str) -> str:
    return shlex.join(["nanopt", *args]).replace(run, "runs/gpt2-small")


def cold_compile_s(ctx: Context) -> float | None:
    """The seconds nanopt's GPT-2 compile took cold in this call (the throughput step's first round)."""
    for record in read_records(ctx.out):
        if (record.get("workload") == "gpt2-small" and record.get("side") == "nanopt" and record.get("round") == 1
                and record.get("compile_s") is not None):
            return float(record["compile_s"])
    return None


def step_find_batch(ctx: Context) -> None:
    run = str(preset(ctx, "gpt2-small"))
    device_bytes = _device_bytes()
    eager = ["--set", "compile=false"]
    # The card's own memory, not the table's entry for its name (an H200 reports 140.4 GiB; the table said 131).
    limit = ["--gpu-memory", f"{device_bytes}B"] if device_bytes else ["--gpu", "cpu", "--gpu-memory", "4GiB"]
    cpu = ["--max-memory", "4GiB"] if device_bytes is None else []
    code, stdout = run_nanopt("estimate", run, "--json", *limit, *eager)
    predicted = json.loads(stdout).get("max_micro_batch") if code == 0 else None
    # Eager on a GPU runs its trials in this one process (a CUDA OOM is caught and freed); a smoke run asks for
    # the same, where the CPU's default would be a process per trial.
    isolation = ["--isolation", "in-process"] if ctx.smoke else []
    args = ["find-batch", run, "--json", "--max", "8" if ctx.smoke else "1024", "--timeout", "120", *eager, *cpu,
            *isolation]
    code, found, seconds = _timed(args)
    record = base_record(ctx, "find-batch:gpt2-small", _shown(args, run))
    record.update(seconds=round(seconds, 2), within_target=seconds <= TARGET_S, micro_batch=None,
                  predicted_micro_batch=predicted, gpu_memory_bytes=device_bytes, compile=False,
                  status="ok" if code == 0 else f"failed (exit {code})")
    trials = 0
    if found is not None:
        (ctx.out / "find_batch.json").write_text(json.dumps({"eager": found}, indent=2))
        record.update(_search_fields(found))
        trials = record["trials"]
    append_record(ctx.out, record)
    _compiled_trial(ctx, run, trials, found, cpu)
    if code != 0:
        raise SystemExit(f"find-batch failed (exit {code})")


def _search_fields(found: dict[str, Any]) -> dict[str, Any]:
    fitting = [t for t in found.get("trials", []) if t.get("fits")]
    at_max = max(fitting, key=lambda t: t["micro_batch_size"], default={})
    calibration = found.get("calibration") or {}
    return {"micro_batch": found.get("max_micro_batch"), "best_micro_batch": found.get("best_micro_batch"),
            "tokens_per_s": at_max.get("tokens_per_s"), "mfu": at_max.get("mfu"),
            "peak_memory_gib": gib(calibration.get("measured_peak_bytes")),
            "predicted_memory_gib": gib(calibration.get("predicted_peak_bytes")),
            "peak_error": calibration.get("peak_error"), "trials": len(found.get("trials", [])),
            "search_complete": found.get("search_complete")}


def _compiled_trial(ctx: Context, run: str, eager_trials: int, eager: dict[str, Any] | None, cpu: list[str]) -> None:
    """One compiled trial at the throughput shape (its graph is in this call's cache), in this process; and the
    default compiled search projected: as many trials as the eager search made, each a cold compilation."""
    micro = str(gpt2_micro(ctx))
    args = ["find-batch", run, "--json", "--start", micro, "--max", micro, "--isolation", "in-process",
            "--set", "compile=true", "--timeout", "120", *cpu]
    before = graph_state()
    code, found, seconds = _timed(args)
    compiled_s = graph_state()[1] - before[1]  # this trial's own (cached) compile, which a cold one replaces
    record = base_record(ctx, "find-batch:gpt2-small", _shown(args, run))
    cold = cold_compile_s(ctx)
    projected = round(eager_trials * (cold + seconds - compiled_s), 1) if cold is not None and eager_trials else None
    record.update(compile=True, seconds=round(seconds, 2), micro_batch=int(micro), cold_compile_s=cold,
                  trial_compile_s=round(compiled_s, 2), projected_default_search_s=projected,
                  projection="trials of the eager search x (the throughput step's cold compile + this trial "
                             "without its own compile)",
                  status="ok" if code == 0 else f"failed (exit {code})")
    if found is not None:
        trial = (found.get("trials") or [{}])[0]
        record.update(fits=trial.get("fits"), step_s=trial.get("step_time_s"), tokens_per_s=trial.get("tokens_per_s"),
                      mfu=trial.get("mfu"), peak_memory_gib=gib(trial.get("peak_memory_bytes")))
        (ctx.out / "find_batch.json").write_text(json.dumps({"eager": eager, "compiled_trial": found}, indent=2))
    append_record(ctx.out, record)
    if code != 0:
        raise SystemExit(f"the compiled find-batch trial failed (exit {code})")


def step_find_batch_compiled(ctx: Context) -> None:
    """The default search on a GPU, timed whole against the 2-minute target: compiled (the GPU's default), a process
    and a compilation per trial, the memory model's start. A smoke run keeps its trials in this process, where
    torch.compile has the smoke's codeless backend (a trial process would compile C++ for minutes)."""
    run = str(preset(ctx, "gpt2-small"))
    smoke = ["--max-memory", "4GiB", "--set", "compile=true", "--isolation", "in-process"] if ctx.smoke else []
    args = ["find-batch", run, "--json", "--max", "8" if ctx.smoke else "1024", "--timeout", "120", *smoke]
    code, found, seconds = _timed(args)
    record = base_record(ctx, "find-batch-compiled:gpt2-small", _shown(args, run))
    record.update(compile=True, seconds=round(seconds, 2), within_target=seconds <= TARGET_S,
                  status="ok" if code == 0 else f"failed (exit {code})")
    if found is not None:
        record.update(_search_fields(found), isolation=found.get("isolation"),
                      trial_seconds=[t.get("step_time_s") for t in found.get("trials", [])])
    append_record(ctx.out, record)
    if code != 0:
        raise SystemExit(f"the compiled find-batch search failed (exit {code})")
