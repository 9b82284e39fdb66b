"""Stacked projections (nanopt.model.stacked: q/k/v, and the Llama's gate/up, as one GEMM each) against nanopt's
one GEMM per layer: the same preset, shape, weights and random tokens, nanopt's real compiled step on both sides,
each compiled once and then timed in alternating rounds, as the throughput step times nanopt against its baseline.
Its comparison record's `speedup` (separate's seconds per step over stacked's) is what decides the model's default
(Transformer.stack_projections).
"""

from __future__ import annotations

import traceback
from typing import Any

from gpusession.records import Context, append_record, gib
from gpusession.throughput import _Bench, _release, _setup, is_oom

SIDES = {"separate": False, "stacked": True}  # side: Transformer.stack_projections' argument


def _build(b: _Bench, stacked: bool) -> Any:
    """nanopt's session on random tokens (bench_train.build_nanopt's), its projections stacked or not; set before
    the first step, so each side compiles its own graph."""
    from bench_train import Side, random_token_session

    from nanopt.train.step import step

    session = random_token_session(b.run, b.rt)
    session.prepared.raw.stack_projections(stacked)

    def set_accum(accum: int) -> None:
        session.accum = session.loader.accum = accum

    return Side("stacked" if stacked else "separate", lambda: step(session), set_accum,
                b.run.train.micro_batch_size * b.run.seq_len)


def _predicted(b: _Bench, stacked: bool) -> int:
    from nanopt.model.memory import estimate_memory

    return estimate_memory(b.run.model, b.run.seq_len, precision=b.rt.precision, compiled=True,
                           activation_checkpointing=False, parallelism="ddp", world_size=1,
                           optimizer=b.run.train.optimizer, step_sequences=max(b.plan.accums) * b.plan.micro_batch,
                           stacked=stacked).total(b.plan.micro_batch)


def step_stacked(ctx: Context, workload: str, preset_name: str, wanted_micro: int, accum_cap: int, timed_micro: int,
                 rounds: int) -> None:
    """Both sides at the throughput step's shape; `rounds` as there (1: each side freed before the next is built)."""
    from bench_train import measure

    from nanopt.devices import MemoryProbe

    b = _setup(ctx, workload, preset_name, wanted_micro, accum_cap, timed_micro)
    command = f"bash bench/gpu_session.sh --only stacked-{'gpt2' if preset_name == 'gpt2-small' else 'llama'}"
    probe = MemoryProbe(b.rt.device)
    alive: dict[str, Any] = {}
    measured: dict[str, dict[int, list[Any]]] = {side: {} for side in SIDES}
    failed: dict[str, str] = {}
    for round_ in range(1, rounds + 1):
        for side, stacked in SIDES.items():
            if side in failed:
                continue
            if rounds == 1:
                alive.clear()
                _release()
            fresh = side not in alive
            try:
                if fresh:
                    alive[side] = _build(b, stacked)
                results = measure(alive[side], b.plan.accums, b.plan.warmup if fresh else 0, b.plan.steps_at,
                                  probe, b.rt.device)
            except Exception as exc:  # noqa: BLE001 (an OOM, or a failure, is this side's record; the other runs)
                traceback.print_exc()
                failed[side] = "oom" if is_oom(exc) else f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                alive.pop(side, None)
                _release()
                append_record(ctx.out, b.record(side, command, round=round_, status=failed[side]))
                continue
            steady = results[0].seconds_per_step
            for m in results:
                measured[side].setdefault(m.accum, []).append(m)
                append_record(ctx.out, b.record(
                    side, command, round=round_, accumulation=m.accum, tokens_per_s=round(m.tokens_per_s, 1),
                    mfu=b.mfu(m.tokens_per_s), step_s=round(m.seconds_per_step, 5), peak_memory_gib=gib(m.peak_bytes),
                    max_allocated_gib=gib(m.max_allocated_bytes), max_reserved_gib=gib(m.max_reserved_bytes),
                    compile_s=b.compile_s(m, steady), predicted_memory_gib=gib(_predicted(b, stacked))))
    for accum in b.plan.accums:
        append_record(ctx.out, _comparison(b, command, accum, measured, failed))
    broken = {side: why for side, why in failed.items() if why != "oom"}
    if broken:
        raise SystemExit(f"stacked {workload}: {broken}")


def _comparison(b: _Bench, command: str, accum: int, measured: dict[str, dict[int, list[Any]]],
                failed: dict[str, str]) -> dict[str, Any]:
    """Stacked against separate at one accumulation: each side's best round, and each round's speedup."""
    record = b.record("comparison", command, baseline="separate", accumulation=accum)
    best = {side: min(runs, key=lambda m: m.seconds_per_step) for side, runs in
            ((side, measured[side].get(accum, [])) for side in SIDES) if runs}
    if "stacked" in best:
        record.update(tokens_per_s=round(best["stacked"].tokens_per_s, 1), mfu=b.mfu(best["stacked"].tokens_per_s),
                      peak_memory_gib=gib(best["stacked"].peak_bytes))
    if "separate" in best:
        record.update(baseline_tokens_per_s=round(best["separate"].tokens_per_s, 1),
                      baseline_mfu=b.mfu(best["separate"].tokens_per_s),
                      baseline_peak_memory_gib=gib(best["separate"].peak_bytes))
    if len(best) == len(SIDES):
        rounds = [round(s.seconds_per_step / t.seconds_per_step, 3) for s, t in
                  zip(measured["separate"][accum], measured["stacked"][accum], strict=False)]
        record.update(speedup=round(best["separate"].seconds_per_step / best["stacked"].seconds_per_step, 3),
                      speedup_rounds=rounds)
    problems = [f"{side} {why}" for side, why in failed.items()]
    record["status"] = "ok" if not problems else "; ".join(problems)
    return record
