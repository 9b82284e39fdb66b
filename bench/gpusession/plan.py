"""The steps of a GPU session, what each costs, and whether a plan fits the one call it is given.

A GPU window is 15 minutes of device time in all, machine start-up (2-4 minutes) included, and one command may run
10 minutes: the session is one call of about 9 minutes (SESSION_BUDGET_S, inside gpu_session.sh's `timeout 590`).
Each step's budget is what it compiles plus what it measures: COMPILE_S per graph, by kind, plus `work_s`. The
smoke run counts the graphs each step really compiles (on the CPU, with a backend that generates no code) and
fails when a step compiles more than its budget counts, and `plan_problems` fails a plan whose budgets add up to
more than the call: budgets cannot silently drift away from what the steps do.
"""

from __future__ import annotations

import dataclasses

SESSION_BUDGET_S = 540.0  # steps only: the parent's imports and the summary fit in the rest of `timeout 590`
SMOKE_STEP_BUDGET_S = 60.0  # a smoke step takes seconds; this only guards against a hang on a loaded 2-core CPU
SMOKE_SESSION_BUDGET_S = 900.0

# Seconds per graph compiled, by kind: 1.5x the slowest the first H100 window measured (torch 2.11, CUDA 13, a fresh
# machine, Inductor's cache empty; bench/RESULTS.md), rounded up to a second. cold: a GPT-2-small-sized training
# graph compiled from nothing (24 s nanopt's, 16.5 s the baseline's); cold-1b: the 1B Llama's (32 s, 24 s); cached:
# a graph this call already compiled once, same model and shape, so Inductor's on-disk FX graph cache serves it and
# only Dynamo's and AOTAutograd's tracing are paid again (9-11 s); tiny: a 2-layer model, where the cost is
# Inductor's start-up (13 s on a fresh machine, 3.6 s warm). Why 1.5x and not 2x: the next window has the same card,
# torch and Inductor, so what varies is the machine's load, not the work; every step of both calls ended far inside
# its budget, time a step leaves goes to the next ones, and a step that runs out is killed and recorded, not lost.
COMPILE_S = {"cold": 36.0, "cold-1b": 48.0, "cached": 17.0, "tiny": 20.0}


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    workloads: tuple[str, ...]  # what its records are called; a step that ends early is recorded under these
    compiles: tuple[str, ...]  # one entry per graph the step compiles, by kind (COMPILE_S)
    work_s: float  # what it measures and its fixed costs (model builds, process starts), compiling aside
    min_s: float  # not started with less than this left
    needs_data: bool = False
    # The session stops when this step fails (not when it runs out of time): what follows would fail the same way.
    fatal: bool = False
    countable: bool = True  # False: it compiles in processes the session cannot see into (pytest's)

    @property
    def budget_s(self) -> float:
        return sum(COMPILE_S[kind] for kind in self.compiles) + self.work_s


# work_s: where the first window measured a step, its seconds beyond compiling, x1.5; else the sum of its parts at the
# rates that window measured (a GPT-2 step at micro-batch 32: 0.07 s; a `nanopt train` process's start, model build,
# final checkpoint and exit: ~10 s).
STEPS = (
    # Versions, CUDA, one big matmul, one compiled bf16 step of a tiny model, which SDPA kernel runs: seconds,
    # and a broken interpreter, path or torch shows here instead of after minutes of compiling (8 s measured).
    Step("preflight", ("preflight",), ("tiny",), 12, 10, fatal=True),
    Step("data", ("tokenize:stdlib",), (), 5, 5),  # 2 s measured
    # nanopt and nanogpt-compiled, each compiled once (the accumulations and the second round reuse the graph).
    # Accumulation 1, then the preset's (16 at 32): ~14 s more than the first window's accumulation 1 alone.
    Step("throughput-gpt2", ("gpt2-small",), ("cold", "cold"), 32, 60),
    Step("memory", ("memory:gpt2-small", "memory:llama-1b"), (), 15, 10),  # eager: four shapes, no compile
    # Eager search (trials in one process), then one compiled trial at the throughput shape (cache hit).
    Step("find-batch", ("find-batch:gpt2-small",), ("cached",), 47, 20, needs_data=True),
    # bf16 compiled at the throughput shape (cache hit), the fp32 reference eager (70 s of the 97 measured).
    Step("bf16-vs-fp32", ("bf16-vs-fp32:gpt2-small",), ("cached",), 127, 30, needs_data=True),
    # The third window's took 31.2 s of a 31 s budget: its graph compiled in 23.6 s, not the cache's 9-11.
    Step("profile", ("profile:gpt2-small",), ("cached",), 19, 20, needs_data=True),
    # The tests' own processes compile (tiny models); 15 tests, two compiled find-batch searches among them: 146 s in
    # the first window, and the second's 12 passed in 123 s before the find-batch tests; the third's 15 took 273 s.
    # Last in every plan on purpose: it also takes whatever the steps before it left.
    Step("gpu-tests", ("gpu-tests",), ("tiny",), 120, 20, countable=False),
    # A 16-layer model compiled twice; each side freed before the next is built (14 s of work measured).
    Step("throughput-llama", ("llama-1b",), ("cold-1b", "cold-1b"), 35, 60),  # and at accumulation 8
    # Three training processes (uninterrupted, killed, resumed), 60 steps and eight checkpoints in all.
    Step("resume", ("resume:gpt2-small",), ("cold", "cached", "cached"), 45, 60, needs_data=True),
    # `off` at the session's shape (cache hit), `head` (the FP8 loss: a graph of its own), `all` (torchao's float8
    # layers: a third graph), 100 steps each. `all` needs torchao, absent on the lent machines unless carried as a
    # wheel (bench/RESULTS.md, "Queue"): without it, recorded as skipped, and its graph's budget is left over.
    Step("fp8", ("fp8:gpt2-small",), ("cached", "cold", "cold"), 48, 40, needs_data=True),
    # The 1B Llama's profile at its throughput shape (micro-batch 8): what the next fix toward 55% MFU is. The
    # second window gave it 68 s and it was cut off; the third's took 53 s, 30 of them compiling: 23 s of work x1.5,
    # rounded up.
    Step("profile-llama", ("profile:llama-1b",), ("cold-1b",), 40, 40, needs_data=True),
    # GPT-2 small at micro-batch 64, both sides: a new shape, so both compile cold.
    Step("throughput-gpt2-64", ("gpt2-small:micro64",), ("cold", "cold"), 40, 60),  # and at accumulation 8
    # AdamW and Muon, 100 steps each at the session's shape (the same graph: Muon's step is not compiled).
    # Then Muon's optimizer step alone, torch's against nanopt's batched one, in the step's process (a few seconds).
    Step("muon", ("muon:gpt2-small", "muon-step:gpt2-small"), ("cached", "cached"), 40, 40, needs_data=True),
    # Random tokens in this process, compiled at the session's shape; 2 + 2 x 10 blocks of 10 steps.
    Step("health", ("health:gpt2-small",), ("cached",), 20, 25),
    # The default compiled search whole (find-batch projected it at 141-153 s): the eager search made 3 trials, each
    # a process of its own compiling its shape cold; its trials' graphs are out of the session's sight.
    Step("find-batch-compiled", ("find-batch-compiled:gpt2-small",), ("cold", "cold", "cold"), 40, 60,
         needs_data=True, countable=False),
    # The 1B with fp8 "all", nanopt alone, at 1 and 8 micro-batches a step: one graph, its casts and scales on top of
    # the bf16 graph's work (GPT-2's FP8 head graph compiled in 39 s against 14 s cached): two cold-1b for one.
    Step("throughput-llama-fp8", ("llama-1b:fp8",), ("cold-1b", "cold-1b"), 30, 60),
    # nanopt with q/k/v in one GEMM against one GEMM each (nanopt.model.stacked), at throughput-gpt2's shape and
    # rounds: two nanopt graphs of their own (a different graph each, so both cold), and its measuring work.
    Step("stacked-gpt2", ("gpt2-small:stacked",), ("cold", "cold"), 32, 60),
    # The same for the 1B (gate/up stacked too), at throughput-llama's shape, one round: each side freed first.
    Step("stacked-llama", ("llama-1b:stacked",), ("cold-1b", "cold-1b"), 35, 60),
    # Each micro-batch replayed from a CUDA graph (train.json cuda_graphs) against launched kernel by kernel, at
    # throughput-gpt2's shape and rounds. Both sides compile the same graph: cold for the first, a cache hit for the
    # second; the graph side's capture (two warm-up micro-steps and the capture) counts as its measuring work.
    Step("graphs-gpt2", ("gpt2-small:graphs",), ("cold", "cached"), 36, 60),
    # `nanopt train` of GPT-2 small with the residual stream in fp32 (a cache hit of the session's graph) and in bf16
    # (train.json bf16_residual: a graph of its own), 100 steps each, as the fp8 step trains its sides.
    Step("residual", ("residual:gpt2-small",), ("cached", "cold"), 32, 40, needs_data=True),
    # `nanopt plan` of a 2e18-FLOP budget for GPT-2 on this card (about GPT-2 small), trained 30 steps at the plan's
    # batch: its predicted step time and peak memory against measured. A graph of the plan's own shape, cold.
    Step("plan-gpt2", ("plan:gpt2",), ("cold",), 45, 40, needs_data=True),
    # bf16 weight copies made once per step (train.json bf16_weight_copies) against autocast's casts, at
    # throughput-llama's shape (one round, each side freed first) and throughput-gpt2's (two rounds): two graphs of
    # their own each (the copies' graph differs), so both cold, and the measuring work of the stacked steps.
    Step("copies-llama", ("llama-1b:copies",), ("cold-1b", "cold-1b"), 35, 60),
    Step("copies-gpt2", ("gpt2-small:copies",), ("cold", "cold"), 32, 60),
)
STEP_NAMES = tuple(s.name for s in STEPS)

# The plans one call can run; "all" is what the smoke run exercises, so no step rots between windows.
PLANS = {
    "window": ("preflight", "data", "throughput-gpt2", "memory", "find-batch", "bf16-vs-fp32", "profile",
               "gpu-tests"),
    # The next window's (bench/RESULTS.md, "Queue"), what decides the most first: the 1B against its baseline (RoPE
    # read from tables), the 1B with fp8 "all" (torchao carried to the machine), CUDA graphs against launched kernels
    # on GPT-2 small at its preset's cadence (the launch gaps between kernels: the largest lever the profiles show;
    # decides cuda_graphs' default), then the GPU tests, the graph's own first, which take what the steps before
    # leave. The 1B's profile waits for a call of its own: its own budget does not fit beside these.
    "next": ("preflight", "data", "throughput-llama", "throughput-llama-fp8", "graphs-gpt2", "gpu-tests"),
    # Stacked q/k/v (and the 1B's gate/up) against separate GEMMs, and the 1B's profile, for a second call.
    "stacked": ("preflight", "stacked-gpt2", "stacked-llama", "profile-llama", "gpu-tests"),
    # For a third call: a budget plan's prediction against its measured step, then what changes the numerics
    # (the bf16 residual stream against fp32, FP8 on GPT-2 small).
    "plan-and-numerics": ("preflight", "data", "plan-gpt2", "residual", "fp8", "gpu-tests"),
    # bf16 weight copies once per step against a cast per micro-batch, the 1B first; the GPU tests start with the
    # copies' own (their fp32 weight gradients out of the GEMM, eager and compiled).
    "copies": ("preflight", "copies-llama", "copies-gpt2", "gpu-tests"),
    "all": STEP_NAMES,
}
GPU_PLANS = tuple(name for name in PLANS if name != "all")  # the plans a window runs: each must fit one call


def step_named(name: str) -> Step:
    return next(s for s in STEPS if s.name == name)


def select_steps(plan: str, only: str | None) -> list[Step]:
    """The steps of `plan`, or those named in `only` (plus `data` when one of them trains on it), in table order."""
    if not only:
        return [step_named(name) for name in PLANS[plan]]
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise ValueError(f"--only: unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    if any(step_named(n).needs_data for n in names):
        names.append("data")  # their dataset lives in this call's scratch folder: tokenize it again
    return [s for s in STEPS if s.name in names]


def parse_budgets(items: list[str]) -> dict[str, float]:
    budgets = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in STEP_NAMES or not seconds:
            raise ValueError(f"--budget {item!r}: expected STEP=SECONDS, STEP one of {', '.join(STEP_NAMES)}")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise ValueError(f"--budget {item!r}: SECONDS must be a number, e.g. {name}=60") from None
    return budgets


def planned_s(step: Step, smoke: bool, overrides: dict[str, float]) -> float:
    if step.name in overrides:
        return overrides[step.name]
    return SMOKE_STEP_BUDGET_S if smoke else step.budget_s


def plan_problems(steps: list[Step], total_s: float, overrides: dict[str, float] | None = None) -> list[str]:
    """Why this plan does not fit a call of `total_s` seconds (GPU budgets), or nothing."""
    planned = {s.name: planned_s(s, False, overrides or {}) for s in steps}
    problems = []
    if sum(planned.values()) > total_s:
        table = ", ".join(f"{name} {seconds:.0f}" for name, seconds in planned.items())
        problems.append(f"the steps' budgets add up to {sum(planned.values()):.0f} s, more than the call's "
                        f"{total_s:.0f} s ({table})")
    problems += [f"{s.name}: budget {planned[s.name]:.0f} s is under its minimum {s.min_s:.0f} s"
                 for s in steps if planned[s.name] < s.min_s]
    return problems


def step_budget(step: Step, left_s: float, planned_after_s: float, smoke: bool,
                overrides: dict[str, float]) -> float | None:
    """Seconds this step may run: its planned budget, plus what earlier steps left unspent (time the steps after it
    have not been promised), never more than is left. None: too little left to start it. A budget given with
    --budget, and a smoke run's (a guard against a hang), is exact: no unspent time is added to it."""
    planned = planned_s(step, smoke, overrides)
    slack = 0.0 if smoke or step.name in overrides else max(0.0, left_s - planned_after_s - planned)
    budget = min(planned + slack, left_s)
    return budget if budget >= min(step.min_s, planned) else None


def graphs_over_budget(step: Step, graphs: int | None) -> str | None:
    """What is wrong when a step compiled more graphs than its budget pays for (None: nothing, or not counted)."""
    if graphs is None or not step.countable or graphs <= len(step.compiles):
        return None
    return (f"{step.name} compiled {graphs} graph(s), its budget counts {len(step.compiles)}: add them to "
            f"bench/gpusession/plan.py's STEPS (each costs COMPILE_S) or stop the step compiling them")


def plan_table(steps: list[Step]) -> str:
    """The plan as text: each step's compiles, work and budget, and where it ends in the call (minutes)."""
    lines, end = ["step               compiles                work_s  budget_s  ends at"], 0.0
    for s in steps:
        end += s.budget_s
        lines.append(f"{s.name:18s} {','.join(s.compiles) or '-':22s} {s.work_s:7.0f} {s.budget_s:9.0f}  "
                     f"{int(end // 60)}:{int(end % 60):02d}")
    return "\n".join(lines)
