"""Steps that run `nanopt train` or `nanopt profile` on GPT-2 small at the throughput shape (so Inductor's on-disk
cache, filled by the throughput step, serves their compilation): bf16 against fp32, resume after a kill, profile.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from gpusession.isolation import fork_nanopt, labelled_note, run_nanopt, start_nanopt
from gpusession.presets import (
    PRESETS,
    copy_run,
    gpt2_micro,
    last_logged_step,
    preset,
    seq_len,
    settings_args,
    train_losses,
)
from gpusession.records import REPO, Context, append_record, base_record, gib, read_jsonl

# The agreement bf16 + compile must show with the fp32 reference over the same steps and data (bench/RESULTS.md):
# bf16 rounds each matmul input to 8 bits of mantissa (relative 2^-8 = 0.4%), so the two runs follow slightly
# different trajectories; what must agree is the curve, not each step.
EARLY_STEPS = 10  # the first steps: the two runs are still nearly the same model
EARLY_ABS_TOL = 0.05  # nats per step
LATE_REL_TOL = 0.02  # mean loss over the last fifth of the steps, relative
RESUME_TOL = 1e-3  # nats: a resumed run continues the uninterrupted one's curve (bench/RESULTS.md's resume target)


def compare_curves(bf16: dict[int, float], fp32: dict[int, float]) -> dict[str, Any]:
    steps = sorted(set(bf16) & set(fp32))
    if not steps:
        return {"compared_steps": 0, "within_tolerance": False}
    early = steps[:EARLY_STEPS]
    late = steps[-max(1, len(steps) // 5):]
    early_max = max(abs(bf16[s] - fp32[s]) for s in early)
    late_bf16 = sum(bf16[s] for s in late) / len(late)
    late_fp32 = sum(fp32[s] for s in late) / len(late)
    late_rel = abs(late_bf16 - late_fp32) / late_fp32
    return {"compared_steps": len(steps), "early_max_abs_diff": round(early_max, 5),
            "late_mean_bf16": round(late_bf16, 5), "late_mean_fp32": round(late_fp32, 5),
            "late_rel_diff": round(late_rel, 5), "max_abs_diff": round(max(abs(bf16[s] - fp32[s]) for s in steps), 5),
            "within_tolerance": early_max <= EARLY_ABS_TOL and late_rel <= LATE_REL_TOL,
            "tolerance": {"early_steps": EARLY_STEPS, "early_abs": EARLY_ABS_TOL, "late_rel": LATE_REL_TOL}}


def tf32_setting() -> str | None:
    """The train.json key that turns TF32 off, where this nanopt has one (a boolean setting named for TF32)."""
    from nanopt.config import TrainConfig

    return next((f.name for f in dataclasses.fields(TrainConfig)
                 if "tf32" in f.name.lower() and isinstance(f.default, bool)), None)


@dataclasses.dataclass(frozen=True)
class Trained:
    """One `nanopt train` of a copy of GPT-2 small: where it ran, how to reproduce it, how it ended."""

    run: Path
    command: str
    seconds: float
    output: str
    code: int
    label: str

    def fields(self) -> dict[str, Any]:
        """Its figures for a record: time, what it compiled and recompiled, its steady tokens/s and MFU (the median
        of the second half of its logged steps: compiling and warm-up excluded), its last loss."""
        note = labelled_note(self.label)
        train = [r for r in read_jsonl(self.run / "metrics.jsonl") if r.get("kind") == "train"]
        steady = train[len(train) // 2:]
        losses = train_losses(self.run)
        return {"seconds": self.seconds, "recompiles": self.output.count("Recompiling"), "graphs": note.get("graphs"),
                "compile_s": note.get("compile_s"), "allow_tf32": note.get("allow_tf32"),
                "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
                "mfu": _median([r.get("mfu") for r in steady]),
                "final_loss": losses[max(losses)] if losses else None}


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def train_copy(ctx: Context, name: str, settings: list[str], label: str, check: bool = True) -> Trained:
    """`nanopt train` of a copy of GPT-2 small with `settings`, forked; with `check`, a failure ends the step."""
    run = copy_run(ctx, preset(ctx, "gpt2-small"), name)
    args = ["train", str(run), "--resume", "none", "--no-live", *settings_args(settings)]
    start = time.perf_counter()
    code, output = fork_nanopt(args, run / "output.txt", log_recompiles=True, label=label)
    seconds = round(time.perf_counter() - start, 2)
    if check and code != 0:
        raise SystemExit(f"{name} failed (exit {code})")
    command = shlex.join(["nanopt", *args]).replace(str(run), "runs/gpt2-small")
    return Trained(run, command, seconds, output, code, label)


def short_run_settings(ctx: Context, steps: int) -> list[str]:
    """A short run at the session's shape (one micro-batch a step), no evaluation (a graph no budget counts), one
    checkpoint at the end."""
    micro, seq = gpt2_micro(ctx), seq_len(preset(ctx, "gpt2-small"))
    return [f"max_steps={steps}", "train_tokens=null", f"micro_batch_size={micro}",
            f"global_batch_tokens={micro * seq}", f"warmup_steps={min(10, steps // 2)}", "eval_interval=0",
            f"checkpoint_interval={steps}"]


def step_bf16_vs_fp32(ctx: Context) -> None:
    """GPT-2 small on the built-in corpus, the same seed and data: bf16 + compile against an fp32 reference, eager,
    with TF32 off where nanopt has a setting for it (else the reference is TF32, and the record says so)."""
    steps, micro = 8 if ctx.smoke else 100, gpt2_micro(ctx)
    seq = seq_len(preset(ctx, "gpt2-small"))
    common = short_run_settings(ctx, steps)
    tf32 = tf32_setting()
    sides = {"bf16": ["precision=bf16", "compile=true"],
             "fp32": ["precision=fp32", "compile=false", *([f"{tf32}=false"] if tf32 else [])]}
    losses, commands = {}, []
    for side, extra in sides.items():
        trained = train_copy(ctx, f"bf16-vs-fp32-{side}", common + extra, f"bf16-vs-fp32:{side}")
        losses[side] = train_losses(trained.run)
        commands.append(trained.command)
        record = base_record(ctx, "bf16-vs-fp32:gpt2-small", trained.command)
        record.update(side=side, steps=steps, micro_batch=micro, seq_len=seq, **trained.fields())
        append_record(ctx.out, record)
    reference_tf32 = labelled_note("bf16-vs-fp32:fp32").get("allow_tf32")
    import torch

    reference = "tf32" if torch.cuda.is_available() and reference_tf32 is not False else "fp32"
    record = base_record(ctx, "bf16-vs-fp32:gpt2-small", " && ".join(commands))
    record.update(side="comparison", reference=reference, reference_allow_tf32=reference_tf32, tf32_setting=tf32,
                  steps=steps, micro_batch=micro, seq_len=seq, **compare_curves(losses["bf16"], losses["fp32"]))
    if not record["within_tolerance"]:
        record["status"] = "outside tolerance"
    append_record(ctx.out, record)


# ------------------------------------------------------------------------------------------------ resume


def step_resume(ctx: Context) -> None:
    """A run killed (SIGKILL) one step after its second checkpoint began, resumed with `--resume auto` (from the
    newest complete checkpoint), against the same run uninterrupted: the curve after the resume must continue the
    uninterrupted one within RESUME_TOL.

    On a GPU two identical runs are not bit-identical (atomic adds in attention's and the embedding's backward), so
    the record also separates a faulty restore from that noise: `first_step_diff` is the resumed run's first step
    against the killed run's own loss at that step (the same weights, optimizer state and batch: it must agree
    within RESUME_TOL, whatever the backward does), and `nondeterminism_floor` is how far the killed run had
    drifted from the uninterrupted one by the kill, with no resume involved."""
    steps, interval = (12, 3) if ctx.smoke else (60, 15)
    micro = gpt2_micro(ctx)
    seq = seq_len(preset(ctx, "gpt2-small"))
    settings = settings_args([f"max_steps={steps}", "train_tokens=null", f"micro_batch_size={micro}",
                              f"global_batch_tokens={micro * seq}", f"warmup_steps={interval}",
                              f"checkpoint_interval={interval}", "eval_interval=0", "compile=true"])
    reference = copy_run(ctx, preset(ctx, "gpt2-small"), "resume-reference")
    code, _ = fork_nanopt(["train", str(reference), "--no-live", "--resume", "none", *settings],
                          reference / "output.txt", label="resume:reference")
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code})")
    killed = copy_run(ctx, preset(ctx, "gpt2-small"), "resume-killed")
    args = ["train", str(killed), "--no-live", *settings]
    kill_after = 2 * interval + 1  # the first checkpoint is surely complete by then
    # Accumulation 1 on one rank: batch N is step N's, so the kill lands as step kill_after + 1 begins.
    pid = start_nanopt([*args, "--resume", "none"], killed / "output.txt", kill_at_batch=kill_after + 1,
                       label="resume:killed")
    _, status = os.waitpid(pid, 0)
    finished_first = os.waitstatus_to_exitcode(status) != -signal.SIGKILL
    killed_after = last_logged_step(killed) if finished_first else kill_after
    print(f"killed after step {killed_after}", flush=True)
    before_kill = train_losses(killed)  # the resume truncates metrics.jsonl to the checkpoint's step
    code, _ = fork_nanopt([*args, "--resume", "auto"], killed / "output.txt", label="resume:resumed")
    if code != 0:
        raise SystemExit(f"the resumed run failed (exit {code})")
    resumes = [r for r in read_jsonl(killed / "metrics.jsonl") if r.get("event") == "resume"]
    resumed_from = int(resumes[-1]["step"]) if resumes else 0
    ours, theirs = train_losses(killed), train_losses(reference)
    after = [step for step in sorted(theirs) if step > resumed_from and step in ours]
    train = shlex.join(["nanopt", *args]).replace(str(killed), "runs/gpt2-small")
    record = base_record(ctx, "resume:gpt2-small", f"{train} --resume none; kill -9 after step {kill_after}; "
                                                   f"{train} --resume auto")
    record.update(steps=steps, checkpoint_interval=interval, micro_batch=micro, killed_after_step=killed_after,
                  resumed_from=resumed_from, compared_steps=len(after), tolerance=RESUME_TOL,
                  **resume_figures(ours, theirs, before_kill, resumed_from))
    diff = record["max_abs_diff_after_resume"]
    if finished_first:
        record["status"] = "not killed: the run finished first"
    elif resumed_from == 0 or diff is None or len(after) != steps - resumed_from:
        record["status"] = "resume does not continue the curve"
    elif record["first_step_diff"] is None or record["first_step_diff"] > RESUME_TOL:
        record["status"] = "resume does not restore the state"
    elif diff > RESUME_TOL:
        record["status"] = "restored exactly; the curves then drift apart (GPU nondeterminism)"
    append_record(ctx.out, record)


def resume_figures(resumed: dict[int, float], reference: dict[int, float], before_kill: dict[int, float],
                   resumed_from: int) -> dict[str, float | None]:
    """The resume's figures from three loss curves ({step: loss}): the resumed run (after resumed_from), the
    uninterrupted reference, and the killed run before its kill."""
    def max_diff(a: dict[int, float], b: dict[int, float], steps: list[int]) -> float | None:
        common = [s for s in steps if s in a and s in b]
        return max((abs(a[s] - b[s]) for s in common), default=None)

    after = sorted(s for s in reference if s > resumed_from)
    replayed = sorted(s for s in before_kill if s > resumed_from)  # the steps the killed run ran twice
    first = resumed_from + 1
    return {"max_abs_diff_after_resume": max_diff(resumed, reference, after),
            "first_step_diff": max_diff(resumed, before_kill, [first]),
            "max_abs_diff_replayed": max_diff(resumed, before_kill, replayed),
            "nondeterminism_floor": max_diff(before_kill, reference, sorted(before_kill))}


# ----------------------------------------------------------------------------------------------- profile


def step_profile(ctx: Context, name: str = "gpt2-small", micro: int | None = None, file: str = "profile.json") -> None:
    """`nanopt profile` of a preset at its throughput shape (GPT-2 small: the session's micro-batch), accumulation 1:
    the category table (matmul, attention, optimizer, data wait), idle share, top kernels; the whole summary into
    OUT/`file`."""
    run = preset(ctx, name)
    micro = gpt2_micro(ctx) if micro is None or ctx.smoke else micro
    trace = ctx.work / f"profile-{name}"
    # The preset's own log interval, not the scratch copy's 1: at 1 every profiled step ran run health's probe (a copy
    # of the weights and four norms over them: by its bytes about 4% of the 1B's step, a tenth of that at 10),
    # which the third window's 1B profile counted as optimizer time.
    logs = json.loads((REPO / PRESETS[name] / "train.json").read_text()).get("log_interval", 10)
    args = ["profile", str(run), "--json", "--no-tensorboard", "--out", str(trace), "--set", "compile=true",
            "--set", f"micro_batch_size={micro}", "--set", f"global_batch_tokens={micro * seq_len(run)}",
            "--set", f"log_interval={logs}"]
    code, stdout = run_nanopt(*args)
    command = shlex.join(["nanopt", *args]).replace(str(run), PRESETS[name]).replace(str(trace), "OUT/profile")
    record = base_record(ctx, f"profile:{name}", command)
    if code != 0:
        record["status"] = f"failed (exit {code})"
        append_record(ctx.out, record)
        raise SystemExit(f"profile failed (exit {code})")
    summary = json.loads(stdout)
    (ctx.out / file).write_text(json.dumps(summary, indent=2))
    shares = {c["category"]: round(c["share"], 4) for c in summary.get("categories", [])}
    record.update(tokens_per_s=summary.get("tokens_per_s"), mfu=summary.get("mfu"),
                  peak_memory_gib=gib(summary.get("peak_memory_bytes")), micro_batch=micro, accumulation=1,
                  categories=shares, data_wait_share=summary.get("data_wait_share"),
                  idle_share=summary.get("idle_share"), host_bound=summary.get("host_bound"),
                  cpu_overhead_share=summary.get("cpu_overhead_share"),
                  compile=summary.get("compile"), kernel_overlap=summary.get("kernel_overlap"),
                  streams=summary.get("streams"), listed_twice=summary.get("kernels_listed_twice_per_step"),
                  notes=summary.get("notes"),
                  top_ops=[{"name": op["name"][:60], "launched_by": op.get("launched_by")}
                           for op in summary.get("top_ops", [])[:8]])
    append_record(ctx.out, record)
