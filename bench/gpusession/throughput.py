"""Throughput: nanopt's real training step against the compiled nanoGPT-style baseline (bench/baseline.py), same
shape, same random tokens, both compiled once and then timed in alternating rounds, each side's figures recorded
the moment they are measured (an out-of-memory error on either side is a record too). Memory: nanopt's predicted
peak against what a real optimizer step held, eager, four shapes.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
from collections.abc import Callable
from typing import Any

from gpusession.presets import PRESETS, preset
from gpusession.records import Context, append_record, base_record, gib, read_records

BASELINE = "nanogpt-compiled"  # the honest baseline; the eager one is bench_train.py's, when time allows


@dataclasses.dataclass(frozen=True)
class ThroughputPlan:
    micro_batch: int  # the one asked for, or less where the memory model says it does not fit this device
    accums: list[int]  # 1, and the preset's accumulation at that micro-batch (capped: see `accum_cap`)
    preset_accum: int
    warmup: int
    steps_at: Callable[[int], int]  # timed optimizer steps at an accumulation


def _fitting_micro_batch(run: Any, wanted: int, device_bytes: int | None, compiled: bool, precision: str) -> int:
    """`wanted`, or the largest power of two below it that the memory model says fits the device."""
    from nanopt.model.memory import estimate_memory

    if device_bytes is None:
        return wanted
    memory = estimate_memory(run.model, run.seq_len, precision=precision, compiled=compiled,
                             activation_checkpointing=False, parallelism="ddp", world_size=1,
                             optimizer=run.train.optimizer)
    largest = memory.max_micro_batch(int(device_bytes * 0.95))
    micro = wanted
    while micro > 1 and micro > largest:
        micro //= 2
    return micro


def throughput_plan(ctx: Context, run: Any, wanted_micro: int, accum_cap: int, timed_micro: int,
                    device_bytes: int | None, compiled: bool, precision: str) -> ThroughputPlan:
    if ctx.smoke:
        return ThroughputPlan(2, [1, 2], run.train.global_batch_tokens // (2 * run.seq_len), 1, lambda accum: 2)
    micro = _fitting_micro_batch(run, wanted_micro, device_bytes, compiled, precision)
    preset_accum = max(1, run.train.global_batch_tokens // (micro * run.seq_len))
    big = min(preset_accum, accum_cap)
    accums = [1, big] if big > 1 else [1]
    # Timed micro-batches per side and round: `timed_micro` / 2 optimizer steps at accumulation 1, and about
    # `timed_micro` micro-batches at the larger accumulation.
    return ThroughputPlan(micro, accums, preset_accum, 3,
                          lambda accum: timed_micro // 2 if accum == 1 else max(1, timed_micro // accum))


def is_oom(exc: BaseException) -> bool:
    import torch

    text = str(exc)
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text))


def _release() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclasses.dataclass
class _Bench:
    """One throughput step's fixed facts: the run at its shape, the runtime, and how records are made from them."""

    ctx: Context
    workload: str  # what its records are called
    preset_name: str  # the repository's preset it measures (PRESETS)
    run: Any
    rt: Any
    plan: ThroughputPlan
    compiled: bool
    fpt: int
    peak_flops: float | None
    predicted: int

    def record(self, side: str, command: str, **fields: Any) -> dict[str, Any]:
        record = base_record(self.ctx, self.workload, command)
        record.update(side=side, micro_batch=self.plan.micro_batch, seq_len=self.run.seq_len,
                      preset_accumulation=self.plan.preset_accum, precision=self.rt.precision,
                      compiled=self.compiled, **fields)
        return record

    def compile_s(self, m: Any, steady_s: float) -> float | None:
        """A side's warm-up beyond its steady steps: what compiling it cost."""
        return None if m.warmup_s is None else round(max(0.0, m.warmup_s - self.plan.warmup * steady_s), 2)

    def mfu(self, tokens_per_s: float) -> float | None:
        from nanopt.model.flops import mfu

        return mfu(tokens_per_s, self.fpt, 1, self.peak_flops)

    def command(self, rounds: int) -> str:
        return (f"python bench/bench_train.py --run {PRESETS[self.preset_name]} --micro-batch {self.plan.micro_batch} "
                f"--accum {' '.join(map(str, self.plan.accums))} --baselines {BASELINE} --rounds {rounds} "
                f"--warmup {self.plan.warmup} --steps {self.plan.steps_at(1)}")


def _setup(ctx: Context, workload: str, preset_name: str, wanted_micro: int, accum_cap: int,
           timed_micro: int) -> _Bench:
    import torch
    from bench_train import with_shape

    from nanopt.config import load_run
    from nanopt.devices import device_peak_flops
    from nanopt.model.flops import flops_per_token
    from nanopt.model.memory import estimate_memory
    from nanopt.runtime import init_runtime

    configured = load_run(preset(ctx, preset_name))
    rt = init_runtime(configured.train.precision)
    device_bytes = torch.cuda.get_device_properties(rt.device).total_memory if rt.device.type == "cuda" else None
    # Planned from the preset's own global batch: its accumulation is the cadence training runs at (with_shape
    # leaves one micro-batch a step, and planned from that the first two windows timed accumulation 1 only).
    plan = throughput_plan(ctx, configured, wanted_micro, accum_cap, timed_micro, device_bytes, True, rt.precision)
    run = with_shape(configured, plan.micro_batch, compile_setting=True)  # compiled, as on a GPU by default
    predicted = estimate_memory(run.model, run.seq_len, precision=rt.precision, compiled=True,
                                activation_checkpointing=False, parallelism="ddp", world_size=1,
                                optimizer=run.train.optimizer,
                                step_sequences=max(plan.accums) * plan.micro_batch).total(plan.micro_batch)
    peak_flops, peak_source = device_peak_flops(rt.device, rt.precision)
    print(f"{workload}: micro-batch {plan.micro_batch} x seq {run.seq_len}, accumulation {plan.accums} (preset "
          f"{plan.preset_accum}), {rt.precision}, compiled, MFU against {peak_source}", flush=True)
    return _Bench(ctx, workload, preset_name, run, rt, plan, True, flops_per_token(run.model, run.seq_len),
                  peak_flops, predicted)


def step_throughput(ctx: Context, workload: str, wanted_micro: int, accum_cap: int, timed_micro: int,
                    rounds: int, preset_name: str | None = None) -> None:
    """Both sides compiled once; then `rounds` alternating rounds (both models kept: 2 rounds need both to fit the
    device; with 1 round each side is freed before the next is built, for models that do not fit twice). The
    records are called `workload`; `preset_name` (default: the workload) is the preset measured."""
    from bench_train import build_side, measure

    from nanopt.devices import MemoryProbe

    b = _setup(ctx, workload, preset_name or workload, wanted_micro, accum_cap, timed_micro)
    probe = MemoryProbe(b.rt.device)  # before any model: it measures the CUDA context
    backend = "inductor" if b.rt.device.type == "cuda" else "eager"
    alive: dict[str, Any] = {}
    measured: dict[str, dict[int, list[Any]]] = {"nanopt": {}, BASELINE: {}}
    failed: dict[str, str] = {}
    for round_ in range(1, rounds + 1):
        for name in ("nanopt", BASELINE):
            if name in failed:
                continue
            if rounds == 1:
                alive.clear()
                _release()
            fresh = name not in alive
            resident = probe.current()
            try:
                if fresh:
                    alive[name] = build_side(name, b.run, b.rt, backend)
                results = measure(alive[name], b.plan.accums, b.plan.warmup if fresh else 0, b.plan.steps_at,
                                  probe, b.rt.device)
            except Exception as exc:  # noqa: BLE001 (an OOM, or a failure, is this side's record; the other runs)
                traceback.print_exc()
                failed[name] = "oom" if is_oom(exc) else f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                alive.pop(name, None)
                _release()
                append_record(ctx.out, b.record(name, b.command(rounds), round=round_, status=failed[name]))
                continue
            steady = results[0].seconds_per_step
            for m in results:
                measured[name].setdefault(m.accum, []).append(m)
                record = b.record(name, b.command(rounds), round=round_, accumulation=m.accum,
                                  tokens_per_s=round(m.tokens_per_s, 1), mfu=b.mfu(m.tokens_per_s),
                                  step_s=round(m.seconds_per_step, 5), peak_memory_gib=gib(m.peak_bytes),
                                  max_allocated_gib=gib(m.max_allocated_bytes),
                                  max_reserved_gib=gib(m.max_reserved_bytes), resident_before_gib=gib(resident),
                                  alone=len(alive) == 1, warmup_s=None if m.warmup_s is None else round(m.warmup_s, 2),
                                  compile_s=b.compile_s(m, steady),
                                  predicted_memory_gib=gib(b.predicted) if name == "nanopt" else None)
                append_record(ctx.out, record)
    for accum in b.plan.accums:
        append_record(ctx.out, _comparison(b, accum, measured, failed, rounds))
    broken = {name: why for name, why in failed.items() if why != "oom"}
    if broken:
        raise SystemExit(f"throughput {workload}: {broken}")


def _comparison(b: _Bench, accum: int, measured: dict[str, dict[int, list[Any]]], failed: dict[str, str],
                rounds: int) -> dict[str, Any]:
    """nanopt against the baseline at one accumulation: the best round of each, and each round's ratio."""
    ours, theirs = measured["nanopt"].get(accum, []), measured[BASELINE].get(accum, [])
    record = b.record("comparison", b.command(rounds), baseline=BASELINE, accumulation=accum, rounds=rounds,
                      predicted_memory_gib=gib(b.predicted))
    if ours:
        best = min(ours, key=lambda m: m.seconds_per_step)
        record.update(tokens_per_s=round(best.tokens_per_s, 1), mfu=b.mfu(best.tokens_per_s),
                      peak_memory_gib=gib(ours[0].peak_bytes))
    if theirs:
        best_theirs = min(theirs, key=lambda m: m.seconds_per_step)
        record.update(baseline_tokens_per_s=round(best_theirs.tokens_per_s, 1),
                      baseline_mfu=b.mfu(best_theirs.tokens_per_s))
    if ours and theirs:
        per_round = [round(t.seconds_per_step / o.seconds_per_step, 3) for o, t in zip(ours, theirs, strict=False)]
        record.update(ratio=round(min(theirs, key=lambda m: m.seconds_per_step).seconds_per_step
                                  / min(ours, key=lambda m: m.seconds_per_step).seconds_per_step, 3),
                      ratio_rounds=per_round, ratio_spread=round(max(per_round) - min(per_round), 3))
    problems = [f"{name} {why}" for name, why in failed.items()]
    record["status"] = "ok" if not problems else "; ".join(problems)
    return record


# ------------------------------------------------------------------------------------------------ FP8


def step_throughput_fp8(ctx: Context, preset_name: str = "llama-1b", wanted_micro: int = 8, accum_cap: int = 8,
                        timed_micro: int = 16) -> None:
    """nanopt with train.json's `fp8` "all" (the head in FP8, and the block linears torchao's measurements favour,
    through its float8 training), compiled, at the throughput shape; its tokens/s and MFU (against the BF16 peak,
    as nanopt reports it) beside this call's bf16 records of the same preset (step throughput-llama before it):
    `speedup` over nanopt in bf16, `ratio` over the baseline. Throughput only: the loss against bf16 is the `fp8`
    step's, on GPT-2. Without torchao, or where nanopt refuses FP8 (the CPU), a `skipped: ...` record."""
    from bench_train import build_side, measure

    from gpusession.comparisons import torchao_installed
    from nanopt.devices import MemoryProbe
    from nanopt.errors import NanoptError
    from nanopt.train.precision.fp8 import check_fp8

    workload = f"{preset_name}:fp8"
    b = _setup(ctx, workload, preset_name, wanted_micro, accum_cap, timed_micro)
    run = dataclasses.replace(b.run, train=dataclasses.replace(b.run.train, fp8="all"))
    command = b.command(1).replace(f"--baselines {BASELINE}", "--baselines") + " --fp8 all"
    if not torchao_installed():
        append_record(ctx.out, b.record("fp8-all", command, fp8="all", status="skipped: torchao not installed"))
        return
    try:
        check_fp8(run, b.rt.device, b.rt.precision, compiled=True)
    except NanoptError as exc:
        line = str(exc).replace(str(b.run.run_dir), PRESETS[preset_name])
        append_record(ctx.out, b.record("fp8-all", command, fp8="all", status=f"skipped: nanopt refused it: {line}"))
        return
    probe = MemoryProbe(b.rt.device)
    backend = "inductor" if b.rt.device.type == "cuda" else "eager"
    try:
        results = measure(build_side("nanopt", run, b.rt, backend), b.plan.accums, b.plan.warmup, b.plan.steps_at,
                          probe, b.rt.device)
    except Exception as exc:  # noqa: BLE001 (an OOM or a failure is the record)
        traceback.print_exc()
        why = "oom" if is_oom(exc) else f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        append_record(ctx.out, b.record("fp8-all", command, fp8="all", status=why))
        return
    bf16 = {r.get("accumulation"): r for r in read_records(ctx.out)
            if r.get("workload") == preset_name and r.get("side") == "comparison"}
    steady = results[0].seconds_per_step
    for m in results:
        same = bf16.get(m.accum, {})
        ours, theirs = same.get("tokens_per_s"), same.get("baseline_tokens_per_s")
        append_record(ctx.out, b.record(
            "fp8-all", command, fp8="all", accumulation=m.accum, tokens_per_s=round(m.tokens_per_s, 1),
            mfu=b.mfu(m.tokens_per_s), step_s=round(m.seconds_per_step, 5), peak_memory_gib=gib(m.peak_bytes),
            compile_s=b.compile_s(m, steady), bf16_tokens_per_s=ours, baseline=BASELINE if theirs else None,
            baseline_tokens_per_s=theirs, speedup=round(m.tokens_per_s / ours, 3) if ours else None,
            ratio=round(m.tokens_per_s / theirs, 3) if theirs else None))


# ---------------------------------------------------------------------------------------------- memory


def memory_shapes(ctx: Context) -> list[tuple[str, int, bool]]:
    """(preset, micro-batch, activation checkpointing): the throughput shapes, with and without checkpointing."""
    sizes = {"gpt2-small": 1 if ctx.smoke else 32, "llama-1b": 2 if ctx.smoke else 8}
    return [(name, micro, ckpt) for name, micro in sizes.items() for ckpt in (False, True)]


def step_memory(ctx: Context) -> None:
    """nanopt's predicted peak against what a real optimizer step held (reserved + context, and allocated), the
    peak reset after the warm-up step that creates AdamW's state. Eager: four compilations would not fit the
    call; the compiled shape's peak is in the throughput records."""
    from bench_train import bench_nanopt, with_shape

    from nanopt.config import load_run
    from nanopt.model.memory import estimate_memory
    from nanopt.runtime import init_runtime

    for name, micro, ckpt in memory_shapes(ctx):
        run = with_shape(load_run(preset(ctx, name)), micro, compile_setting=False, activation_checkpointing=ckpt)
        rt = init_runtime(run.train.precision)
        predicted = estimate_memory(run.model, run.seq_len, precision=rt.precision, compiled=False,
                                    activation_checkpointing=ckpt, parallelism="ddp", world_size=1,
                                    optimizer=run.train.optimizer, step_sequences=0).total(micro)
        command = (f"nanopt estimate {PRESETS[name]} --set micro_batch_size={micro} --set compile=false "
                   f"--set activation_checkpointing={str(ckpt).lower()}")
        record = base_record(ctx, f"memory:{name}", command)
        record.update(micro_batch=micro, seq_len=run.seq_len, activation_checkpointing=ckpt, compiled=False,
                      precision=rt.precision, predicted_memory_gib=gib(predicted))
        try:
            [m] = bench_nanopt(run, rt, [1], warmup=1, steps=1)
            record.update(peak_memory_gib=gib(m.peak_bytes), max_allocated_gib=gib(m.max_allocated_bytes),
                          max_reserved_gib=gib(m.max_reserved_bytes), tokens_per_s=round(m.tokens_per_s, 1),
                          predicted_error=round(predicted / m.peak_bytes - 1, 4) if rt.device.type == "cuda"
                          else None)
        except Exception as exc:  # noqa: BLE001 (an OOM is a finding; anything else too, recorded as such)
            if not is_oom(exc):
                traceback.print_exc()
            record.update(status="oom" if is_oom(exc) else f"failed: {type(exc).__name__}: {str(exc)[:200]}")
        _release()
        append_record(ctx.out, record)
