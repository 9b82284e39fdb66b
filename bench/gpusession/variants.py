"""nanopt's real compiled step in two variants that compute the same thing, side by side: the same preset, shape,
weights and random tokens, each side compiled once and then timed in alternating rounds, as the throughput step
times nanopt against its baseline. The comparison record's `speedup` (the first side's seconds per step over the
second's) decides the setting's default.

stacked: q/k/v, and the Llama's gate/up, as one GEMM each (nanopt.model.stacked) against one GEMM per layer;
decides Transformer.stack_projections.
graphs: each micro-batch replayed from a CUDA graph (train.json cuda_graphs, nanopt.train.parallel.graphed_step) against
launched kernel by kernel; decides cuda_graphs' default.
copies: the blocks' linear layers from bf16 weight copies made once per step (train.json bf16_weight_copies,
nanopt.model.weight_copies) against autocast's cast per micro-batch; decides bf16_weight_copies' default.
A side refused where it cannot apply (the CPU of a smoke run) is recorded as refused and the other still runs.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

from gpusession.records import Context, append_record, gib
from gpusession.throughput import _Bench, _release, _setup, is_oom


@dataclasses.dataclass(frozen=True)
class Question:
    sides: tuple[str, str]  # (what runs today, the candidate)
    train: Callable[[Any, bool], Any] = lambda train, on: train  # train.json's settings for a side
    session: Callable[[Any, bool], None] = lambda session, on: None  # set on the built session, before its first step
    stacked: bool = False  # the memory prediction's `stacked` follows the side
    copies: bool = False  # ... and its `weight_copies`


QUESTIONS = {
    "stacked": Question(("separate", "stacked"), session=lambda s, on: s.prepared.raw.stack_projections(on),
                        stacked=True),
    "graphs": Question(("launched", "graphed"), train=lambda t, on: dataclasses.replace(t, cuda_graphs=on)),
    "copies": Question(("cast", "copies"), train=lambda t, on: dataclasses.replace(t, bf16_weight_copies=on),
                       copies=True),
}


def _build(b: _Bench, question: Question, on: bool) -> Any:
    """nanopt's session on random tokens (bench_train.build_nanopt's) for one side; each side compiles its own
    graph. ConfigError: the side cannot run here."""
    from bench_train import Side, random_token_session

    from nanopt.train.parallel.graphed_step import check_cuda_graphs
    from nanopt.train.precision.weight_copies import check_bf16_weight_copies
    from nanopt.train.step import step

    run = dataclasses.replace(b.run, train=question.train(b.run.train, on))
    check_cuda_graphs(run, b.rt.device, b.rt.precision, 1)  # as `nanopt train` checks them at session start
    check_bf16_weight_copies(run, b.rt.precision, sharded=False, world_size=1)
    session = random_token_session(run, b.rt)
    question.session(session, on)

    def set_accum(accum: int) -> None:
        session.accum = session.loader.accum = accum

    return Side(question.sides[on], lambda: step(session), set_accum, b.run.train.micro_batch_size * b.run.seq_len)


def _predicted(b: _Bench, question: Question, on: bool) -> int:
    from nanopt.model.memory import estimate_memory

    return estimate_memory(b.run.model, b.run.seq_len, precision=b.rt.precision, compiled=True,
                           activation_checkpointing=False, parallelism="ddp", world_size=1,
                           optimizer=b.run.train.optimizer, step_sequences=max(b.plan.accums) * b.plan.micro_batch,
                           stacked=question.stacked and on,
                           weight_copies=question.copies and on).total(b.plan.micro_batch)


def step_variants(ctx: Context, name: str, workload: str, preset_name: str, wanted_micro: int, accum_cap: int,
                  timed_micro: int, rounds: int) -> None:
    """Both sides of QUESTIONS[name] at the throughput step's shape; `rounds` as there (1: each side freed before
    the next is built)."""
    from bench_train import measure

    from nanopt.devices import MemoryProbe
    from nanopt.errors import ConfigError

    question = QUESTIONS[name]
    b = _setup(ctx, workload, preset_name, wanted_micro, accum_cap, timed_micro)
    command = f"bash bench/gpu_session.sh --only {name}-{'gpt2' if preset_name == 'gpt2-small' else 'llama'}"
    probe = MemoryProbe(b.rt.device)
    alive: dict[str, Any] = {}
    measured: dict[str, dict[int, list[Any]]] = {side: {} for side in question.sides}
    failed: dict[str, str] = {}
    for round_ in range(1, rounds + 1):
        for on, side in enumerate(question.sides):
            if side in failed:
                continue
            if rounds == 1:
                alive.clear()
                _release()
            fresh = side not in alive
            try:
                if fresh:
                    alive[side] = _build(b, question, bool(on))
                results = measure(alive[side], b.plan.accums, b.plan.warmup if fresh else 0, b.plan.steps_at,
                                  probe, b.rt.device)
            except ConfigError as exc:  # this side cannot run here: recorded as such, the other side runs
                failed[side] = f"refused: {exc}"
                append_record(ctx.out, b.record(side, command, round=round_, status=failed[side]))
                continue
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
                    compile_s=b.compile_s(m, steady), predicted_memory_gib=gib(_predicted(b, question, bool(on)))))
    for accum in b.plan.accums:
        append_record(ctx.out, _comparison(b, command, accum, question.sides, measured, failed))
    broken = {side: why for side, why in failed.items() if why != "oom" and not why.startswith("refused")}
    if broken:
        raise SystemExit(f"{name} {workload}: {broken}")


def _comparison(b: _Bench, command: str, accum: int, sides: tuple[str, str], measured: dict[str, dict[int, list[Any]]],
                failed: dict[str, str]) -> dict[str, Any]:
    """The candidate against what runs today at one accumulation: each side's best round, and each round's
    speedup."""
    today, candidate = sides
    record = b.record("comparison", command, baseline=today, accumulation=accum)
    best = {side: min(runs, key=lambda m: m.seconds_per_step) for side, runs in
            ((side, measured[side].get(accum, [])) for side in sides) if runs}
    if candidate in best:
        record.update(tokens_per_s=round(best[candidate].tokens_per_s, 1), mfu=b.mfu(best[candidate].tokens_per_s),
                      peak_memory_gib=gib(best[candidate].peak_bytes))
    if today in best:
        record.update(baseline_tokens_per_s=round(best[today].tokens_per_s, 1),
                      baseline_mfu=b.mfu(best[today].tokens_per_s),
                      baseline_peak_memory_gib=gib(best[today].peak_bytes))
    if len(best) == len(sides):
        rounds = [round(s.seconds_per_step / t.seconds_per_step, 3) for s, t in
                  zip(measured[today][accum], measured[candidate][accum], strict=False)]
        record.update(speedup=round(best[today].seconds_per_step / best[candidate].seconds_per_step, 3),
                      speedup_rounds=rounds)
    problems = [f"{side} {why}" for side, why in failed.items()]
    record["status"] = "ok" if not problems else "; ".join(problems)
    return record
