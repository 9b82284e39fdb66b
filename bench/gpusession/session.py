"""One GPU session: the measurements bench/RESULTS.md's targets need, in ONE call of about 9 minutes, every record in
OUT/results.jsonl the moment it exists and on stdout as one compact line, a summary table at the end.

    git rev-parse --short HEAD > bench/COMMIT        # before shipping the tree (the GPU machine gets no .git)
    bash bench/gpu_session.sh                        # on the GPU machine: the next window's queue (bench/RESULTS.md)
    bash bench/gpu_session.sh --plan window          # the first window's steps (on a card not measured yet)
    python3 bench/gpu_session.py --out /tmp/smoke --smoke   # CPU: every step, tiny shapes (the test suite)

Each step runs in its own process with its own wall-clock budget (plan.py): a step that hangs, runs out of memory
or crashes is killed or ends, is recorded as such, and the next step runs; the preflight failing stops the call
(what follows would fail the same way). OUT receives at most 8 files: results.jsonl, session.log (each step's
commands and output), env.txt, find_batch.json, profile.json, profile_llama.json, gpu_tests.txt. Scratch
(datasets, runs, traces) goes to a temporary folder removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpusession import isolation
from gpusession.plan import (
    GPU_PLANS,
    PLANS,
    SESSION_BUDGET_S,
    SMOKE_SESSION_BUDGET_S,
    STEP_NAMES,
    Step,
    graphs_over_budget,
    parse_budgets,
    plan_problems,
    planned_s,
    select_steps,
    step_budget,
    step_named,
)
from gpusession.records import (
    LOG,
    REPO,
    RESULTS,
    Context,
    append_record,
    compact,
    headline,
    plain_record,
    read_commit,
    read_records,
    torch_version,
)

ENTRY = Path(__file__).resolve().parents[1] / "gpu_session.py"


def preload() -> None:
    """Import torch and what the steps use once, so that each forked step starts in milliseconds instead of
    seconds. Importing initializes no CUDA (the parent must never touch the device: a forked child could then not
    use it; gpu_session.sh also sets PYTORCH_NVML_BASED_CUDA_CHECK=1, so even is_available() would not)."""
    for path in (str(REPO), str(isolation.BENCH)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import bench_train  # noqa: F401  (torch, torch._dynamo, the model, the step, the baseline)
    import torch

    import gpusession.steps  # noqa: F401  (every step's module)
    import nanopt.cli  # noqa: F401

    if torch.cuda.is_initialized():  # an import touched the device: forked steps could not use it
        raise RuntimeError("CUDA was initialized while importing; run with --isolation spawn")


class Interrupted(Exception):
    """The call's own `timeout` (SIGTERM) ended the session: what ran is recorded, the summary still printed."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def resolve_out(given: Path | None, environ: dict[str, str]) -> Path:
    """--out, else $OUT. A relative folder other than $OUT is refused: on the GPU machine only $OUT comes back,
    and a folder in the copied tree is lost with the machine."""
    out_env = environ.get("OUT") or None
    if given is None:
        if out_env is None:
            raise ValueError("no output folder: give --out DIR, or set OUT (on the GPU machine, the folder that "
                             "comes back)")
        return Path(out_env)
    if not given.is_absolute() and str(given) != out_env:
        raise ValueError(f"--out {given}: a relative folder stays in the copied tree and is lost with the GPU "
                         f"machine; give an absolute path, or leave --out out to use $OUT")
    return given


def log(out: Path, text: str) -> None:
    with open(out / LOG, "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    print(text.rstrip("\n"), flush=True)


class Tail:
    """Prints each complete new line of results.jsonl as one compact line on stdout (records from every step's
    process and from this one): stdout's last 12,000 characters come back even when the files do not."""

    def __init__(self, path: Path) -> None:
        # Records an earlier call left in the same OUT are not this call's: start after them.
        self.path, self.offset, self.partial = path, path.stat().st_size if path.exists() else 0, b""

    def poll(self) -> None:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size <= self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for line in lines:
            try:
                print(compact(json.loads(line)), flush=True)
            except json.JSONDecodeError:
                print(f"R (unreadable) {line[:200]!r}", flush=True)


# ------------------------------------------------------------------------------------------------ a step


def _start(ctx: Context, step: Step, how: str) -> int:
    if how == "fork":
        from gpusession.steps import WORKERS

        work = WORKERS[step.name]
        return isolation.forked(ctx.out / LOG, lambda: isolation.run_worker(
            step.name, ctx.graphs_dir(step.name), ctx.smoke, lambda: work(ctx)), new_session=True)
    argv = [str(ENTRY), "--worker", step.name, "--out", str(ctx.out), "--work", str(ctx.work), "--commit",
            ctx.commit] + (["--smoke"] if ctx.smoke else [])
    return isolation.start_spawned(argv, ctx.out / LOG)


def _log_tail(ctx: Context, offset: int, chars: int = 1500) -> str:
    with open(ctx.out / LOG, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")[-chars:]


def run_step(ctx: Context, step: Step, budget: float, how: str, tail: Tail) -> tuple[str, str | None]:
    """The step in its own process group, killed with everything it started when its budget runs out. Returns its
    status and what is wrong with its graph count (None: nothing)."""
    plan = "a smoke run's guard" if ctx.smoke else f"planned {step.budget_s:.0f} s"
    log(ctx.out, f"\n=== {step.name} (budget {budget:.0f} s, {plan}) ===")
    offset = (ctx.out / LOG).stat().st_size
    start = time.perf_counter()
    pid = _start(ctx, step, how)
    try:
        code = isolation.wait_for(pid, budget, tail.poll)
    except Interrupted:
        _finish(ctx, step, budget, "killed by the call's timeout", time.perf_counter() - start, offset)
        tail.poll()
        raise
    tail.poll()  # the step's last records, before its closing line
    status = f"timed out after {budget:.0f} s" if code is None else "ok" if code == 0 else f"failed (exit {code})"
    problem = _finish(ctx, step, budget, status, time.perf_counter() - start, offset)
    tail.poll()
    return status, problem


def _finish(ctx: Context, step: Step, budget: float, status: str, seconds: float, offset: int) -> str | None:
    log(ctx.out, f"=== {step.name}: {status} in {seconds:.1f} s ===")
    if status != "ok":
        print("| " + _log_tail(ctx, offset).replace("\n", "\n| "), flush=True)  # why, in stdout's tail too
        _record_outcome(ctx, step, status)
    return _step_record(ctx, step, status, seconds, budget)


def _step_record(ctx: Context, step: Step, status: str, seconds: float, budget: float | None) -> str | None:
    """The step's own record: status, seconds, budget, the graphs its processes compiled and the seconds that took
    (what the next window's budgets are made from). Returns what is wrong with its graph count, if anything."""
    notes = isolation.notes_in(ctx.graphs_dir(step.name))
    graphs = sum(n["graphs"] for n in notes) if notes and step.countable else None
    problem = graphs_over_budget(step, graphs)
    record = plain_record(ctx, f"step:{step.name}", f"bash bench/gpu_session.sh --only {step.name}", status)
    record.update(seconds=round(seconds, 1), budget_s=None if budget is None else round(budget, 1),
                  planned_s=step.budget_s, graphs=graphs, budgeted_graphs=len(step.compiles),
                  compile_s=round(sum(n["compile_s"] for n in notes), 1) if notes else None, graph_check=problem)
    append_record(ctx.out, record)
    return problem


def _record_outcome(ctx: Context, step: Step, status: str) -> None:
    """A step that did not finish: one record per workload saying so, beside any it measured before (their count
    in `records_before`), so that nothing a reader looks for is silently absent or silently partial."""
    counts: dict[str, int] = {}
    for record in read_records(ctx.out):
        counts[record.get("workload")] = counts.get(record.get("workload"), 0) + 1
    for workload in step.workloads:
        record = plain_record(ctx, workload, f"bash bench/gpu_session.sh --only {step.name}", status)
        record["records_before"] = counts.get(workload, 0)
        append_record(ctx.out, record)


# ---------------------------------------------------------------------------------------------- the call


def run_session(ctx: Context, steps: list[Step], total_s: float, overrides: dict[str, float], how: str,
                tail: Tail) -> tuple[dict[str, str], list[str]]:
    deadline = time.perf_counter() + total_s
    outcome: dict[str, str] = {}
    problems: list[str] = []
    for i, step in enumerate(steps):
        left = deadline - time.perf_counter()
        after = sum(planned_s(s, ctx.smoke, overrides) for s in steps[i + 1:])
        budget = step_budget(step, left, after, ctx.smoke, overrides)
        failed_first = next((s.name for s in steps[:i] if s.fatal and outcome.get(s.name, "").startswith("failed")),
                            None)
        if failed_first:
            outcome[step.name] = f"skipped: {failed_first} failed"
        elif step.needs_data and outcome.get("data", "ok") != "ok":
            outcome[step.name] = "skipped: the data step failed"
        elif budget is None:
            outcome[step.name] = f"skipped: {left:.0f} s left of the call's budget"
        else:
            outcome[step.name], problem = run_step(ctx, step, budget, how, tail)
            problems += [problem] if problem else []
            continue
        log(ctx.out, f"=== {step.name}: {outcome[step.name]} ===")
        _record_outcome(ctx, step, outcome[step.name])
        _step_record(ctx, step, outcome[step.name], 0.0, None)
        tail.poll()
    return outcome, problems


def _in_summary(record: dict[str, Any], compared: set[str]) -> bool:
    """Every record but the steps' own (the table above) and a throughput round that went well where its workload
    has a comparison (which holds each side's best round; every round is on stdout as its own R line already)."""
    workload = str(record.get("workload", ""))
    if workload.startswith("step:"):
        return False
    return not (workload in compared and record.get("round") is not None and record.get("status") == "ok")


def summary(out: Path, header: str, skip: int = 0) -> str:
    """The table printed last: each step's status, time and compiles, then the records' headline figures (the
    first `skip` records are an earlier call's)."""
    records = read_records(out)[skip:]
    compared = {str(r.get("workload")) for r in records if r.get("side") == "comparison"}
    lines = ["", "=" * 30 + " summary " + "=" * 30, header,
             f"{'step':18s} {'status':28s} {'s':>6s} {'budget':>6s} {'graphs':>7s} {'compile_s':>9s}"]
    for r in (r for r in records if str(r.get("workload", "")).startswith("step:")):
        graphs = f"{r['graphs']}/{r['budgeted_graphs']}" if r.get("graphs") is not None else "-"
        lines.append(f"{r['workload'][5:]:18s} {str(r['status'])[:28]:28s} {r.get('seconds') or 0:6.0f} "
                     f"{r.get('budget_s') or 0:6.0f} {graphs:>7s} {r.get('compile_s') or 0:9.1f}")
    lines.append("figures:")
    lines += ["  " + headline(r)[:220] for r in records if _in_summary(r, compared)]
    return "\n".join(lines)


def gpu_name_from_smi() -> str | None:
    """The first GPU's name as nvidia-smi gives it (what torch.cuda.get_device_name says too), None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return names[0].strip() if names else None


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT; created; appended to)")
    parser.add_argument("--commit", help="the commit measured (default: bench/COMMIT, else git, else unknown)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: every step, tiny shapes, seconds each")
    parser.add_argument("--plan", choices=sorted(PLANS), default=None,
                        help="next (default): the queue's steps (bench/RESULTS.md); window: the first window's; "
                             "all (smoke default)")
    parser.add_argument("--only", help=f"comma-separated steps, run in table order: {','.join(STEP_NAMES)}")
    parser.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                        help="one step's exact wall-clock budget (repeatable)")
    parser.add_argument("--total-budget", type=float, default=None,
                        help=f"seconds for all steps (default {SESSION_BUDGET_S:.0f}; smoke "
                             f"{SMOKE_SESSION_BUDGET_S:.0f})")
    parser.add_argument("--isolation", choices=["fork", "spawn"], default="fork",
                        help="fork: each step forked from a process that imported torch once (fast); spawn: each "
                             "step a fresh interpreter (the fallback should forking misbehave)")
    parser.add_argument("--worker", choices=STEP_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.smoke:  # the CPU even on a GPU host: tiny shapes, and the same records wherever the suite runs
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.worker:  # --isolation spawn: one step in this fresh interpreter
        from gpusession.steps import WORKERS

        ctx = Context(out=args.out.resolve(), work=args.work, smoke=args.smoke, commit=args.commit or "unknown",
                      gpu=None if args.smoke else gpu_name_from_smi())
        isolation.run_worker(args.worker, ctx.graphs_dir(args.worker), ctx.smoke, lambda: WORKERS[args.worker](ctx))
        return 0
    try:
        out = resolve_out(args.out, dict(os.environ))
        steps = select_steps(args.plan or ("all" if args.smoke else "next"), args.only)
        overrides = parse_budgets(args.budget)
    except ValueError as exc:
        parser.error(str(exc))
    # The GPU plans must fit a call; a smoke run checks the table itself, a GPU run the steps it was given.
    checked = [[step_named(n) for n in PLANS[p]] for p in GPU_PLANS] if args.smoke else [steps]
    problems = [p for plan in checked for p in plan_problems(plan, SESSION_BUDGET_S, {} if args.smoke else overrides)]
    if problems and args.smoke:
        parser.error("; ".join(problems))
    out.mkdir(parents=True, exist_ok=True)
    earlier = len(read_records(out))
    commit, source = read_commit(args.commit)
    total = args.total_budget or (SMOKE_SESSION_BUDGET_S if args.smoke else SESSION_BUDGET_S)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.isolation == "fork":
        preload()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="gpu-session-") as work:
        ctx = Context(out=out.resolve(), work=Path(work), smoke=args.smoke, commit=commit,
                      gpu=None if args.smoke else gpu_name_from_smi())
        header = (f"gpu_session: commit {commit} ({source}), gpu {ctx.gpu}, torch {torch_version()}, "
                  f"{'smoke' if args.smoke else 'GPU'}, out {ctx.out}")
        tail = Tail(ctx.out / RESULTS)
        log(ctx.out, header + f"\nsteps {','.join(s.name for s in steps)}, budget {total:.0f} s")
        for problem in problems:
            log(ctx.out, f"WARNING: {problem}")
        try:
            outcome, graph_problems = run_session(ctx, steps, total, overrides, args.isolation, tail)
        except Interrupted:
            interrupted, outcome, graph_problems = True, {}, []
        tail.poll()
    for problem in graph_problems:
        log(out, f"BUDGET: {problem}")
    print(summary(out, header, earlier), flush=True)
    if interrupted:
        return 124
    if any(outcome.get(s.name, "").startswith("failed") for s in steps if s.fatal):
        return 3
    return 0 if all(status == "ok" for status in outcome.values()) and not graph_problems else 1
