"""A budget plan's prediction against the step it trains: `nanopt plan` for the GPT-2 family on this card, at a
budget whose compute-optimal size is about GPT-2 small's (N = sqrt(C / 120): 2e18 FLOPs buys 129M parameters),
then `nanopt train` of that run for a few dozen steps at the plan's own batch, micro-batch and memory rung. The
prediction training wrote before its first step (the plan's assumed MFU: no preflight ran) is put beside what the
steps measured: the step time (the median of the second half of the logged steps, compiling excluded) and the
peak memory per GPU.
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from typing import Any

from gpusession.isolation import fork_nanopt, run_nanopt
from gpusession.records import Context, append_record, base_record, gib, read_jsonl

BUDGET = "2e18"  # FLOPs
SMOKE_BUDGET = "1min"  # the CPU of a smoke run: the same commands on a plan this machine trains in seconds
STEPS, SMOKE_STEPS = 30, 4


def _gpu_key(ctx: Context) -> str:
    from nanopt.hardware import detect_gpu

    if ctx.smoke:
        return "cpu"
    found = detect_gpu(ctx.gpu or "")
    if found is None:
        raise SystemExit(f"plan-gpt2: {ctx.gpu!r} is not in nanopt's GPU table, so nothing can be planned for it")
    return found.key


def step_plan(ctx: Context) -> None:
    """Plan, train `STEPS` steps of the plan, and record predicted against measured (plan.json's choices beside)."""
    run = ctx.work / "planned"
    budget, steps = (SMOKE_BUDGET, SMOKE_STEPS) if ctx.smoke else (BUDGET, STEPS)
    plan_args = ["plan", "--budget", budget, "--gpu", _gpu_key(ctx), "--family", "gpt2", "--data", str(ctx.data),
                 "--out", str(run), "--max-epochs", "1e6", "--json"]
    code, output = run_nanopt(*plan_args)
    if code != 0:
        raise SystemExit(f"plan-gpt2: nanopt plan failed (exit {code})")
    plan = json.loads(output)
    # The plan's shape, batch and rung as written; only its length is cut to the steps this call can afford.
    sets = [f"max_steps={steps}", "train_tokens=null", "eval_interval=0", f"checkpoint_interval={steps}",
            "log_interval=2"]
    train_args = ["train", str(run), "--no-live", *(a for s in sets for a in ("--set", s))]
    started = time.perf_counter()
    code, _ = fork_nanopt(train_args, run / "output.txt", label="plan-gpt2")
    command = " && ".join(shlex.join(["nanopt", *args]).replace(str(run), "runs/planned")
                          .replace(str(ctx.data), "data/stdlib") for args in (plan_args, train_args))
    record = base_record(ctx, "plan:gpt2", command)
    record.update(_planned(plan), seconds=round(time.perf_counter() - started, 2))
    if code != 0:
        record["status"] = f"failed (exit {code})"
        append_record(ctx.out, record)
        raise SystemExit(f"plan-gpt2: nanopt train failed (exit {code})")
    record.update(_against(json.loads((run / "prediction.json").read_text()),
                           [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train"]))
    append_record(ctx.out, record)


def _planned(plan: dict[str, Any]) -> dict[str, Any]:
    model, batch = plan["model"], plan["batch"]
    return {"budget": plan["budget"]["text"], "params": model["params"],
            "shape": f"{model['layers']} x {model['hidden_size']}", "seq_len": model["seq_len"],
            "micro_batch": batch["micro_batch_size"], "grad_accum": batch["grad_accum"], "rung": batch["rung"],
            "global_batch_tokens": batch["global_batch_tokens"], "mfu": plan["device"]["mfu"],
            "mfu_source": plan["throughput"]["source"]}  # assumed on a GPU; measured by the plan on a CPU


def _against(prediction: dict[str, Any], train: list[dict[str, Any]]) -> dict[str, Any]:
    steady = train[len(train) // 2:]
    step_times = [r["step_time_s"] for r in steady if r.get("step_time_s")]
    peaks = [r["peak_memory_bytes"] for r in train if r.get("peak_memory_bytes")]
    measured_step = statistics.median(step_times) if step_times else None
    measured_peak = max(peaks) if peaks else None
    return {"predicted_step_s": prediction["step_s"], "measured_step_s": measured_step,
            "step_ratio": measured_step / prediction["step_s"] if measured_step else None,
            "predicted_peak_gib": gib(prediction["peak_memory_bytes"]), "measured_peak_gib": gib(measured_peak),
            "peak_ratio": measured_peak / prediction["peak_memory_bytes"] if measured_peak else None,
            "mfu": statistics.median(r["mfu"] for r in steady if r.get("mfu") is not None)
            if any(r.get("mfu") is not None for r in steady) else None,
            "status": "ok"}
