"""Side-by-side `nanopt train` runs of GPT-2 small at the session's shape, the same seed, data and steps for every side:
FP8 against bf16 (train.json `fp8`: off, head, all), the residual stream in bf16 against fp32 (`bf16_residual`),
Muon against AdamW (`optimizer`), each at its configured learning rate. Each side's record is written as soon as it
has trained, the comparison with the reference side (off, false, adamw) in the record of the side compared; a side
this machine cannot run is a `skipped: ...` record, not a failure.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from gpusession.presets import gpt2_micro, preset, seq_len, train_losses
from gpusession.records import Context, append_record, base_record, read_jsonl
from gpusession.training import Trained, compare_curves, short_run_settings, train_copy

STEPS = 100  # per side: 3.3M tokens at 32 x 1024, the bf16-vs-fp32 comparison's length
SMOKE_STEPS = 8
FP8_MODES = ("off", "head", "all")
OPTIMIZERS = ("adamw", "muon")
CURVE_KEYS = ("compared_steps", "early_max_abs_diff", "late_rel_diff", "max_abs_diff", "within_tolerance")
REFUSED = 2  # nanopt's exit status for a setting it refuses (one line: what, where, what to do)


def torchao_installed() -> bool:
    """Whether `import torchao` would find it, without importing it (heavy; and this process must not touch CUDA
    before it forks `nanopt`)."""
    try:
        return importlib.util.find_spec("torchao") is not None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        return False


def _steps(ctx: Context) -> int:
    return SMOKE_STEPS if ctx.smoke else STEPS


def _record(ctx: Context, workload: str, command: str, side: str, steps: int) -> dict[str, Any]:
    record = base_record(ctx, workload, command)
    record.update(side=side, steps=steps, micro_batch=gpt2_micro(ctx), seq_len=seq_len(preset(ctx, "gpt2-small")))
    return record


def _refusal(trained: Trained) -> str:
    """nanopt's one line saying why it refused (the last line of its output)."""
    lines = [line.strip() for line in trained.output.splitlines() if line.strip()]
    line = lines[-1].removeprefix("error: ").replace(str(trained.run), "runs/gpt2-small") if lines else ""
    return line[:200] or f"exit {trained.code}"


def _mean_of_last_fifth(losses: dict[int, float]) -> float | None:
    steps = sorted(losses)[-max(1, len(losses) // 5):]
    return round(sum(losses[s] for s in steps) / len(steps), 5) if steps else None


# --------------------------------------------------------------------------------------------------- FP8


def step_fp8(ctx: Context) -> None:
    """fp8 off (bf16), head and all, compiled, `STEPS` steps each. Per FP8 side: its steady tokens/s and MFU (against
    the BF16 peak, as nanopt reports it), `speedup` over off, and its loss curve against off's with the bf16
    tolerance. `all` needs torchao: without it, `skipped: torchao not installed`; a mode nanopt refuses on this
    machine (every FP8 mode on the CPU, where the smoke run shows the refusal is recorded) is `skipped: nanopt
    refused it: <its line>`."""
    skipped = {} if torchao_installed() else {"all": "skipped: torchao not installed"}
    _sweep(ctx, "fp8", "fp8", FP8_MODES, skipped)


def step_residual(ctx: Context) -> None:
    """The residual stream in fp32 (the default) and in bf16 (train.json bf16_residual), compiled, `STEPS` steps
    each: the bf16 side's `speedup` and its loss curve against the fp32 stream's with the bf16 tolerance, which
    decides whether the setting is offered. Refused outside bf16 (the CPU of a smoke run): `skipped: ...`."""
    _sweep(ctx, "residual", "bf16_residual", ("false", "true"), {})


def _sweep(ctx: Context, name: str, key: str, values: tuple[str, ...], skipped: dict[str, str]) -> None:
    """`nanopt train` of GPT-2 small once per value of train.json's `key`, the first the reference the others are
    compared with (speed, and the loss curve within the bf16 tolerance)."""
    steps = _steps(ctx)
    workload = f"{name}:gpt2-small"
    common = [*short_run_settings(ctx, steps), "compile=true"]
    reference: Trained | None = None
    failed = []
    for value in values:
        if value in skipped:
            record = _record(ctx, workload, f"nanopt train runs/gpt2-small --set {key}={value} ...", value, steps)
            record["status"] = skipped[value]
            append_record(ctx.out, record)
            continue
        trained = train_copy(ctx, f"{name}-{value}", [*common, f"{key}={value}"], f"{name}:{value}", check=False)
        record = _record(ctx, workload, trained.command, value, steps)
        if trained.code == REFUSED and value != values[0]:
            record["status"] = f"skipped: nanopt refused it: {_refusal(trained)}"
        elif trained.code != 0:
            record["status"] = f"failed (exit {trained.code})"
            failed.append(value)
        else:
            record.update(trained.fields())
            if value == values[0]:
                reference = trained
            elif reference is not None:
                record.update(_against(trained, reference, values[0]))
        append_record(ctx.out, record)
    if failed:
        raise SystemExit(f"{name}: {', '.join(failed)} failed")


def _against(trained: Trained, reference: Trained, reference_name: str) -> dict[str, Any]:
    """A side against the reference: speed, and the loss curve within the bf16 tolerance (training.compare_curves)."""
    ours, theirs = trained.fields(), reference.fields()
    curves = compare_curves(train_losses(trained.run), train_losses(reference.run))
    fields = {key: curves.get(key) for key in CURVE_KEYS}
    fields.update(reference=reference_name, speedup=_ratio(ours["tokens_per_s"], theirs["tokens_per_s"]),
                  status="ok" if curves["within_tolerance"] else "outside tolerance")
    return fields


# --------------------------------------------------------------------------------------------------- Muon


def step_muon(ctx: Context) -> None:
    """AdamW, then Muon (on the hidden matrices; AdamW on the rest at the same learning rate), each at the preset's
    configured learning rates, `STEPS` steps on the same batches: the loss at equal tokens (the mean of the last fifth
    of the steps, and the last step's) and the steady tokens/s of each; Muon's record carries the differences."""
    steps = _steps(ctx)
    common = [*short_run_settings(ctx, steps), "compile=true"]
    adamw: dict[str, Any] = {}
    for optimizer in OPTIMIZERS:
        trained = train_copy(ctx, f"muon-{optimizer}", [*common, f"optimizer={optimizer}"], f"muon:{optimizer}")
        record = _record(ctx, "muon:gpt2-small", trained.command, optimizer, steps)
        record.update(trained.fields(), **_learning_rates(trained, optimizer), tokens=_tokens(trained),
                      late_mean_loss=_mean_of_last_fifth(train_losses(trained.run)))
        if optimizer == "adamw":
            adamw = record
        else:
            record.update(reference="adamw", reference_late_mean_loss=adamw.get("late_mean_loss"),
                          loss_diff=_difference(record.get("late_mean_loss"), adamw.get("late_mean_loss")),
                          speed_ratio=_ratio(record.get("tokens_per_s"), adamw.get("tokens_per_s")))
        append_record(ctx.out, record)
    _muon_step_alone(ctx)


def _muon_step_alone(ctx: Context) -> None:
    """Muon's optimizer step alone, torch's against nanopt's batched one, on GPT-2 small's 48 block matrices (tiny
    ones in a smoke run): in this process, after the step's last fork (bench/bench_muon_step.py)."""
    import bench_muon_step

    shapes = ["64x32:4", "32x64:2"] if ctx.smoke else list(bench_muon_step.GPT2_SMALL)
    measured = bench_muon_step.measure(shapes, 2 if ctx.smoke else 10, 2 if ctx.smoke else 3)
    record = base_record(ctx, "muon-step:gpt2-small", "python bench/bench_muon_step.py")
    record.update({key: value for key, value in measured.items() if key not in ("device", "torch")})
    append_record(ctx.out, record)


def _difference(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None else round(ours - theirs, 5)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 4) if ours and theirs else None


def _learning_rates(trained: Trained, optimizer: str) -> dict[str, float | None]:
    """The learning rates the run was configured with: the preset's train.json and nanopt's defaults."""
    from nanopt.config import load_run

    train = load_run(trained.run).train
    return {"learning_rate": train.learning_rate,
            "muon_learning_rate": train.muon_learning_rate if optimizer == "muon" else None}


def _tokens(trained: Trained) -> int | None:
    train = [r for r in read_jsonl(trained.run / "metrics.jsonl") if r.get("kind") == "train"]
    return train[-1].get("tokens") if train else None
