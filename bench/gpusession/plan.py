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

# Seconds per graph compiled, by kind. cold: a GPT-2- or Llama-sized training graph compiled from nothing (the
# review's 1-2 minutes per model shape on an H100, at its low end); cached: a graph this call already compiled
# once, same model and shape, so Inductor's on-disk FX graph cache serves it and only Dynamo's and AOTAutograd's
# tracing are paid again; tiny: a 2-layer model, where the cost is Inductor's start-up, not the model.
COMPILE_S = {"cold": 90.0, "cached": 20.0, "tiny": 30.0}


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


STEPS = (
    # Versions, CUDA, one big matmul, one compiled bf16 step of a tiny model, which SDPA kernel runs: seconds,
    # and a broken interpreter, path or torch shows here instead of after minutes of compiling.
    Step("preflight", ("preflight",), ("tiny",), 30, 10, fatal=True),
    Step("data", ("tokenize:stdlib",), (), 25, 10),
    # nanopt and nanogpt-compiled, each compiled once (the accumulations and the second round reuse the graph).
    Step("throughput-gpt2", ("gpt2-small",), ("cold", "cold"), 25, 60),
    Step("memory", ("memory:gpt2-small", "memory:llama-1b"), (), 30, 15),  # eager: four shapes, no compile
    # Eager search (trials in one process), then one compiled trial at the throughput shape (cache hit).
    Step("find-batch", ("find-batch:gpt2-small",), ("cached",), 40, 20, needs_data=True),
    # bf16 compiled at the throughput shape (cache hit), the fp32 reference eager: 100 steps each, no eval.
    Step("bf16-vs-fp32", ("bf16-vs-fp32:gpt2-small",), ("cached",), 60, 30, needs_data=True),
    Step("profile", ("profile:gpt2-small",), ("cached",), 15, 20, needs_data=True),
    # The tests' own processes compile (tiny models); their time is what is left, and the step is last on purpose.
    Step("gpu-tests", ("gpu-tests",), ("tiny",), 15, 20, countable=False),
    # The next window's (bench/RESULTS.md, "Queue"): a 16-layer model compiled twice; three training processes.
    Step("throughput-llama", ("llama-1b",), ("cold", "cold"), 60, 90),
    Step("resume", ("resume:gpt2-small",), ("cold", "cached", "cached"), 45, 60, needs_data=True),
)
STEP_NAMES = tuple(s.name for s in STEPS)

# The plans one call can run; "all" is what the smoke run exercises, so no step rots between windows.
PLANS = {
    "window": ("preflight", "data", "throughput-gpt2", "memory", "find-batch", "bf16-vs-fp32", "profile",
               "gpu-tests"),
    "next": ("preflight", "data", "throughput-llama", "resume"),
    "all": STEP_NAMES,
}


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
    lines, end = ["step              compiles                work_s  budget_s  ends at"], 0.0
    for s in steps:
        end += s.budget_s
        lines.append(f"{s.name:17s} {','.join(s.compiles) or '-':22s} {s.work_s:7.0f} {s.budget_s:9.0f}  "
                     f"{int(end // 60)}:{int(end % 60):02d}")
    return "\n".join(lines)
