"""Each step's name to the function its process runs (the table of steps and budgets is plan.py's)."""

from __future__ import annotations

from collections.abc import Callable

from gpusession.comparisons import step_fp8, step_muon, step_residual
from gpusession.find_batch import step_find_batch, step_find_batch_compiled
from gpusession.gputests import step_gpu_tests
from gpusession.health import step_health
from gpusession.planned import step_plan
from gpusession.preflight import step_data, step_preflight
from gpusession.records import Context
from gpusession.throughput import step_memory, step_throughput, step_throughput_fp8
from gpusession.training import step_bf16_vs_fp32, step_profile, step_resume
from gpusession.variants import step_variants

WORKERS: dict[str, Callable[[Context], None]] = {
    "preflight": step_preflight,
    "data": step_data,
    # GPT-2 small: both models fit twice over, so two alternating rounds; the 1B Llama does not: one round.
    "throughput-gpt2": lambda ctx: step_throughput(ctx, "gpt2-small", wanted_micro=32, accum_cap=16, timed_micro=32,
                                                   rounds=2),
    "memory": step_memory,
    "find-batch": step_find_batch,
    "bf16-vs-fp32": step_bf16_vs_fp32,
    "profile": step_profile,
    "gpu-tests": step_gpu_tests,
    "throughput-llama": lambda ctx: step_throughput(ctx, "llama-1b", wanted_micro=8, accum_cap=8, timed_micro=16,
                                                    rounds=1),
    "resume": step_resume,
    "fp8": step_fp8,
    # The 1B Llama at its throughput shape, where it reached 50.5% MFU: what its profile says the next fix is.
    "profile-llama": lambda ctx: step_profile(ctx, "llama-1b", micro=8, file="profile_llama.json"),
    # At 32, 11% of the GPU idle and host overhead 69% of the step: a larger micro-batch amortizes the launches.
    "throughput-gpt2-64": lambda ctx: step_throughput(ctx, "gpt2-small:micro64", wanted_micro=64, accum_cap=16,
                                                      timed_micro=32, rounds=2, preset_name="gpt2-small"),
    "muon": step_muon,
    "health": step_health,
    "find-batch-compiled": step_find_batch_compiled,
    # The 1B with fp8 "all" (torchao carried to the machine), beside throughput-llama's bf16 figures.
    "throughput-llama-fp8": step_throughput_fp8,
    # q/k/v (and the 1B's gate/up) as one GEMM each against one per layer, at the throughput steps' shapes.
    "stacked-gpt2": lambda ctx: step_variants(ctx, "stacked", "gpt2-small:stacked", "gpt2-small", wanted_micro=32,
                                              accum_cap=16, timed_micro=32, rounds=2),
    "stacked-llama": lambda ctx: step_variants(ctx, "stacked", "llama-1b:stacked", "llama-1b", wanted_micro=8,
                                               accum_cap=8, timed_micro=16, rounds=1),
    # A budget plan for the GPT-2 family on this card, trained a few dozen steps: predicted against measured.
    "plan-gpt2": step_plan,
    # The residual stream in bf16 against fp32: speed, and the loss curve within the bf16 tolerance.
    "residual": step_residual,
    # Each micro-batch replayed from a CUDA graph against launched kernel by kernel, at GPT-2's preset cadence.
    "graphs-gpt2": lambda ctx: step_variants(ctx, "graphs", "gpt2-small:graphs", "gpt2-small", wanted_micro=32,
                                             accum_cap=16, timed_micro=32, rounds=2),
    # bf16 weight copies made once per step against autocast's cast per micro-batch, at the throughput steps' shapes
    # and cadences: the 1B first (its weights' bytes per micro-batch are the most).
    "copies-llama": lambda ctx: step_variants(ctx, "copies", "llama-1b:copies", "llama-1b", wanted_micro=8,
                                              accum_cap=8, timed_micro=16, rounds=1),
    "copies-gpt2": lambda ctx: step_variants(ctx, "copies", "gpt2-small:copies", "gpt2-small", wanted_micro=32,
                                             accum_cap=16, timed_micro=32, rounds=2),
}
