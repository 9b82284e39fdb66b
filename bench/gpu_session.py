"""One GPU session: everything issues #12 (throughput) and #13 (memory, find-batch, bf16, profile, GPU tests) need,
measured in one call of at most 10 minutes, written into one output folder.

    bench/gpu_session.sh OUT                                   # on the GPU machine (PYTHONPATH=$PWD, no install)
    python bench/gpu_session.py --out OUT --commit abc1234     # the same, by hand
    python bench/gpu_session.py --out OUT2 --only bf16-vs-fp32,profile,gpu-tests   # the tail, in a second call
    python bench/gpu_session.py --out /tmp/smoke --smoke       # CPU, tiny shapes, every step in seconds

Each step runs in its own process with its own wall-clock budget: a step that hangs, runs out of memory or
crashes is killed or ends, is recorded as such in results.jsonl, and the next step still runs; a step is skipped
when the session's remaining budget is below its minimum. OUT receives results.jsonl (one JSON object per
measurement, schema in bench/RESULTS.md), session.log (every step's command and output), env.txt, find_batch.json,
profile.json and gpu_tests.txt; scratch files (datasets, run directories, traces) go to a temporary folder that is
removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = "results.jsonl"
LOG = "session.log"
SESSION_BUDGET_S = 540.0  # under the 10-minute call, with room for start-up and copying OUT back
# A smoke step takes seconds; its budget only guards against a hang, generous for a loaded 2-core machine.
SMOKE_STEP_BUDGET_S = 60.0
SMOKE_SESSION_BUDGET_S = 600.0
REQUIRED_KEYS = ("date", "gpu", "torch", "commit", "command", "workload", "tokens_per_s", "mfu",
                 "baseline_tokens_per_s", "peak_memory_gib", "predicted_memory_gib", "baseline")
GIB = 2**30


# ---------------------------------------------------------------------------------------------- the steps


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    workloads: tuple[str, ...]  # what its records are called; a step that produced none is recorded under these
    gpu_budget_s: float
    min_s: float  # skipped when the session has less than this left
    needs_data: bool = False


# GPU budgets are estimates for one H100 (compilation ~30-60 s per compiled model); they add up to more than one
# session: the first call measures env..find-batch, a second `--only bf16-vs-fp32,profile,gpu-tests` the rest.
STEPS = (
    Step("env", ("env",), 20, 5),
    Step("throughput-gpt2", ("gpt2-small",), 110, 40),
    Step("throughput-llama", ("llama-1b",), 140, 60),
    Step("memory", ("memory:gpt2-small", "memory:llama-1b"), 90, 30),
    Step("data", ("tokenize:stdlib",), 40, 10),
    Step("find-batch", ("find-batch:gpt2-small",), 130, 60, needs_data=True),
    Step("bf16-vs-fp32", ("bf16-vs-fp32:gpt2-small",), 150, 60, needs_data=True),
    Step("profile", ("profile:gpt2-small",), 90, 40, needs_data=True),
    Step("gpu-tests", ("gpu-tests",), 150, 30),
    Step("resume", ("resume:gpt2-small",), 180, 90, needs_data=True),
)
STEP_NAMES = tuple(s.name for s in STEPS)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every step's process knows: where to write, the shapes to use, and the fields every record carries."""

    out: Path
    work: Path  # scratch: datasets, run directories, traces
    smoke: bool
    commit: str
    gpu: str | None = None  # the parent's answer, from nvidia-smi: it never touches CUDA itself

    @property
    def data(self) -> Path:
        return self.work / "stdlib"


PRESETS = {"gpt2-small": "runs/gpt2-small", "llama-1b": "runs/llama-3.2-1b"}  # workload: the repository's preset


def _preset(ctx: Context, name: str) -> Path:
    """A run directory for `name` ("gpt2-small" or "llama-1b") in the scratch folder: the repository's preset on a
    GPU, a tiny model of the same architecture in a smoke run; its data is the built-in corpus tokenized by the
    `data` step (a larger model vocabulary than the dataset's is fine)."""
    run = ctx.work / "runs" / name
    if (run / "model.json").exists():
        return run
    run.mkdir(parents=True)
    source = REPO / PRESETS[name]
    model = json.loads((source / "model.json").read_text())
    train = json.loads((source / "train.json").read_text())
    if ctx.smoke:
        model.update(hidden_size=32, intermediate_size=64 if model["architecture"] == "llama" else 128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1 if name == "llama-1b" else 2,
                     max_position_embeddings=64, vocab_size=1024)
        model.pop("head_dim", None)
    train.update(data=str(ctx.data), eval_interval=10**6, checkpoint_interval=10**6, log_interval=1)
    train.pop("_note", None)
    (run / "model.json").write_text(json.dumps(model, indent=2))
    (run / "train.json").write_text(json.dumps(train, indent=2))
    return run


# ------------------------------------------------------------------------------------- records and logging


def base_record(ctx: Context, workload: str, command: str) -> dict[str, Any]:
    """The keys every line of results.jsonl has, measurement keys null until a step fills them."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "gpu": gpu,
            "torch": torch.__version__, "commit": ctx.commit, "command": command, "workload": workload,
            "tokens_per_s": None, "mfu": None, "baseline_tokens_per_s": None, "peak_memory_gib": None,
            "predicted_memory_gib": None, "baseline": None, "status": "ok"}


def append_record(out: Path, record: dict[str, Any]) -> None:
    """One line, flushed at once: a step killed later keeps what it measured so far."""
    with open(out / RESULTS, "a") as f:
        f.write(json.dumps(record) + "\n")


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


def child_env() -> dict[str, str]:
    """This process's environment, with nanopt importable from the copied tree (no install needed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _fork() -> int:
    """os.fork without Python 3.12's warning about the one native thread torch's import starts: nothing the
    children need is locked by it (the fallback, should that ever change: --isolation spawn)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def _forked(output: Path, work: Callable[[], None], new_session: bool = False) -> int:
    """`work()` in a forked child whose stdout and stderr append to `output`; returns the child's pid. The child
    exits with work's exit status (a traceback in `output` and status 1 when it raised); with `new_session` it
    leads a process group of its own, so killing the group ends everything it started."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = _fork()
    if pid:
        return pid
    code = 1
    try:
        if new_session:
            os.setsid()
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        work()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 (reported through the exit status and the output)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def start_nanopt(args: list[str], output: Path, log_recompiles: bool = False, kill_at_batch: int | None = None) -> int:
    """`nanopt ARGS` as a process of its own, forked from this one (no second torch import), its stdout and stderr
    into `output`; with `log_recompiles`, torch.compile's recompilations logged there (TORCH_LOGS=recompiles); with
    `kill_at_batch` N, the process sends itself SIGKILL when training asks for its Nth batch (a kill at a known
    step, with no race against a fast or a descheduled machine). Returns its pid. The calling process must not
    have touched CUDA yet (a forked child could not use it)."""
    print(f"$ {shlex.join(['nanopt', *args])}" + ("  (TORCH_LOGS=recompiles)" if log_recompiles else ""), flush=True)

    def work() -> None:
        if kill_at_batch is not None:
            _kill_at_batch(kill_at_batch)
        if log_recompiles:
            import torch._logging

            torch._logging.set_logs(recompiles=True)
        from nanopt.cli import main as nanopt_main

        nanopt_main(args)

    return _forked(output, work)


def _kill_at_batch(n: int) -> None:
    """In a forked child: SIGKILL this process when the training loader is asked for its nth batch."""
    from nanopt.data import loader

    original, calls = loader.TrainLoader.next_batch, [0]

    def next_batch(self: Any) -> Any:
        calls[0] += 1
        if calls[0] >= n:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    loader.TrainLoader.next_batch = next_batch


def fork_nanopt(args: list[str], output: Path, log_recompiles: bool = False) -> tuple[int, str]:
    """start_nanopt, waited for: its exit status and its output (the tail also into session.log)."""
    output.unlink(missing_ok=True)
    pid = start_nanopt(args, output, log_recompiles)
    _, status = os.waitpid(pid, 0)
    text = output.read_text(errors="replace")
    print(text[-3000:], flush=True)
    return os.waitstatus_to_exitcode(status), text


def run_nanopt(*args: str) -> tuple[int, str]:
    """`nanopt ARGS` in this step's process (no second torch import): its exit status and stdout. Its stderr, and
    the tail of its stdout, go to session.log."""
    import contextlib
    import io

    from nanopt.cli import main as nanopt_main

    print(f"$ {shlex.join(['nanopt', *args])}", flush=True)
    stdout = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout):
        try:
            nanopt_main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    print(stdout.getvalue()[-2000:], flush=True)
    return code, stdout.getvalue()


# ---------------------------------------------------------------------------------------- step: env


def step_env(ctx: Context) -> None:
    import torch

    lines = [f"python {sys.version.split()[0]}", f"torch {torch.__version__}", f"cuda {torch.version.cuda}",
             f"cudnn {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}",
             f"commit {ctx.commit}"]
    sdpa = {}
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        probe = getattr(torch.backends.cuda, flag, None)
        sdpa[flag] = probe() if probe is not None else None
    lines.append(f"sdpa {json.dumps(sdpa)}")
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        smi = "nvidia-smi: not available"
    lines.append(smi)
    (ctx.out / "env.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))
    record = base_record(ctx, "env", "nvidia-smi; python -c 'import torch'")
    record.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), sdpa=sdpa,
                  python=sys.version.split()[0], cuda_available=torch.cuda.is_available())
    append_record(ctx.out, record)


# ---------------------------------------------------------------------------------- step: throughput


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
    # Timed micro-batches per side are what the budget allows: `timed_micro` / 2 optimizer steps at accumulation
    # 1, and about `timed_micro` micro-batches at the larger accumulation.
    return ThroughputPlan(micro, accums, preset_accum, 3,
                          lambda accum: timed_micro // 2 if accum == 1 else max(1, timed_micro // accum))


def step_throughput(ctx: Context, workload: str, wanted_micro: int, accum_cap: int, timed_micro: int) -> None:
    import torch
    from bench_train import BASELINES, bench_side, with_shape

    from nanopt.config import load_run
    from nanopt.model.flops import flops_per_token, mfu
    from nanopt.model.memory import estimate_memory
    from nanopt.runtime import device_peak_flops, init_runtime
    from nanopt.train.parallel import resolve_compile

    run = load_run(_preset(ctx, workload))
    rt = init_runtime(run.train.precision)
    compiled = resolve_compile(run.train.compile, rt.device)
    device_bytes = torch.cuda.get_device_properties(rt.device).total_memory if rt.device.type == "cuda" else None
    plan = throughput_plan(ctx, run, wanted_micro, accum_cap, timed_micro, device_bytes, compiled, rt.precision)
    run = with_shape(run, plan.micro_batch)
    peak_flops, peak_source = device_peak_flops(rt.device, rt.precision)
    fpt = flops_per_token(run.model, run.seq_len)
    predicted = estimate_memory(run.model, run.seq_len, precision=rt.precision, compiled=compiled,
                                activation_checkpointing=False, parallelism="ddp", world_size=1,
                                optimizer=run.train.optimizer).total(plan.micro_batch)
    backend = "inductor" if rt.device.type == "cuda" else "eager"
    print(f"{workload}: micro-batch {plan.micro_batch} x seq {run.seq_len}, accumulation {plan.accums} (preset "
          f"{plan.preset_accum}), {rt.precision}, nanopt compile {compiled}, MFU against {peak_source}", flush=True)
    ours = {m.accum: m for m in bench_side("nanopt", run, rt, plan.accums, plan.warmup, plan.steps_at)}
    for baseline in BASELINES:
        try:
            theirs = {m.accum: m for m in bench_side(baseline, run, rt, plan.accums, plan.warmup, plan.steps_at,
                                                     backend)}
        except torch.cuda.OutOfMemoryError:  # nanopt's figures still count; the record says why none beside them
            theirs = {}
        for accum, m in ours.items():
            command = (f"python bench/bench_train.py --run {PRESETS[workload]} --micro-batch {plan.micro_batch} "
                       f"--accum {accum} --baselines {baseline} --rounds 1 --warmup {plan.warmup} "
                       f"--steps {plan.steps_at(accum)}")
            record = base_record(ctx, workload, command)
            record.update(tokens_per_s=round(m.tokens_per_s, 1), mfu=mfu(m.tokens_per_s, fpt, 1, peak_flops),
                          peak_memory_gib=gib(m.peak_bytes), predicted_memory_gib=gib(predicted), baseline=baseline,
                          micro_batch=plan.micro_batch, seq_len=run.seq_len, accumulation=accum,
                          preset_accumulation=plan.preset_accum, precision=rt.precision, compiled=compiled,
                          step_s=round(m.seconds_per_step, 5), max_allocated_gib=gib(m.max_allocated_bytes),
                          max_reserved_gib=gib(m.max_reserved_bytes), ratio=None)
            other = theirs.get(accum)
            if other is None:
                record["status"] = "baseline out of memory"
            else:
                record.update(baseline_tokens_per_s=round(other.tokens_per_s, 1),
                              baseline_mfu=mfu(other.tokens_per_s, fpt, 1, peak_flops),
                              baseline_peak_memory_gib=gib(other.peak_bytes),
                              ratio=round(other.seconds_per_step / m.seconds_per_step, 3))
            append_record(ctx.out, record)
            print(f"  accum {accum:3d}: nanopt {m.tokens_per_s:12,.0f} tokens/s, {baseline} "
                  f"{record['baseline_tokens_per_s']} tokens/s, ratio {record['ratio']}x", flush=True)


# -------------------------------------------------------------------------------------- step: memory


def memory_shapes(ctx: Context) -> list[tuple[str, int, bool]]:
    """(preset, micro-batch, activation checkpointing): two sizes each, with and without checkpointing."""
    if ctx.smoke:  # each kind once: the eight shapes of a GPU session take too long on a 2-core CPU
        return [("gpt2-small", 1, False), ("gpt2-small", 2, True), ("llama-1b", 2, False), ("llama-1b", 1, True)]
    sizes = {"gpt2-small": (16, 32), "llama-1b": (4, 8)}
    return [(name, micro, ckpt) for name, micros in sizes.items() for ckpt in (False, True) for micro in micros]


def step_memory(ctx: Context) -> None:
    """nanopt's predicted peak against what a real optimizer step allocated and reserved. Eager (compile off):
    eight compilations do not fit the budget; the compiled shapes are in the throughput records."""
    import torch
    from bench_train import bench_nanopt, with_shape

    from nanopt.config import load_run
    from nanopt.model.memory import estimate_memory
    from nanopt.runtime import init_runtime

    for name, micro, ckpt in memory_shapes(ctx):
        run = with_shape(load_run(_preset(ctx, name)), micro, compile_setting=False, activation_checkpointing=ckpt)
        rt = init_runtime(run.train.precision)
        predicted = estimate_memory(run.model, run.seq_len, precision=rt.precision, compiled=False,
                                    activation_checkpointing=ckpt, parallelism="ddp", world_size=1,
                                    optimizer=run.train.optimizer).total(micro)
        command = (f"nanopt estimate {PRESETS[name]} --set micro_batch_size={micro} --set compile=false "
                   f"--set activation_checkpointing={str(ckpt).lower()}")
        record = base_record(ctx, f"memory:{name}", command)
        record.update(micro_batch=micro, seq_len=run.seq_len, activation_checkpointing=ckpt, compiled=False,
                      precision=rt.precision, predicted_memory_gib=gib(predicted))
        try:
            # Two steps: the first creates AdamW's state, the second is the peak a training run sees.
            [m] = bench_nanopt(run, rt, [1], warmup=1, steps=1)
            record.update(peak_memory_gib=gib(m.peak_bytes), max_allocated_gib=gib(m.max_allocated_bytes),
                          max_reserved_gib=gib(m.max_reserved_bytes), tokens_per_s=round(m.tokens_per_s, 1),
                          predicted_error=round(predicted / m.peak_bytes - 1, 4) if rt.device.type == "cuda"
                          else None)
        except torch.cuda.OutOfMemoryError:
            record.update(status="oom")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        append_record(ctx.out, record)
        print(f"  {name} micro {micro} ckpt {ckpt}: predicted {record['predicted_memory_gib']} GiB, peak "
              f"{record['peak_memory_gib']} GiB, allocated {record.get('max_allocated_gib')} GiB, "
              f"{record['status']}", flush=True)


# ---------------------------------------------------------------------------------------- step: data


def step_data(ctx: Context) -> None:
    """The built-in corpus tokenized here, as a user without `datasets` and without internet would."""
    import importlib.util

    try:
        datasets_importable = importlib.util.find_spec("datasets") is not None
    except (ImportError, ValueError):  # sys.modules["datasets"] = None, as the smoke test blocks it
        datasets_importable = False
    args = ["tokenize", "--out", str(ctx.data), "--max-tokens", "2M" if not ctx.smoke else "50k", "--json"]
    if ctx.smoke:
        args += ["--tokenizer-sample-mb", "1"]
    start = time.perf_counter()
    code, stdout = run_nanopt(*args)
    seconds = time.perf_counter() - start
    record = base_record(ctx, "tokenize:stdlib", shlex.join(["nanopt", *args]).replace(str(ctx.data), "data/stdlib"))
    record.update(seconds=round(seconds, 2), datasets_importable=datasets_importable,
                  status="ok" if code == 0 else f"failed (exit {code})")
    if code == 0:
        summary = json.loads(stdout)
        record.update(vocab_size=summary.get("vocab_size"), train_tokens=summary.get("budget", {}).get("train_tokens"))
    append_record(ctx.out, record)
    if code != 0:
        raise SystemExit(f"tokenize failed (exit {code})")


# ---------------------------------------------------------------------------------- step: find-batch


def step_find_batch(ctx: Context) -> None:
    """`nanopt find-batch` on GPT-2 small: its seconds and answer, against `nanopt estimate`'s prediction."""
    run = _preset(ctx, "gpt2-small")
    # Eager: its trials run in this one process (a CUDA OOM caught and freed), which is what fits the 2-minute
    # goal; with compile every trial is a fresh process and a fresh compilation (30-60 s each on an H100).
    eager = ["--set", "compile=false"]
    code, stdout = run_nanopt("estimate", str(run), "--json", "--gpu", _this_gpu(), *eager)
    predicted = json.loads(stdout).get("max_micro_batch") if code == 0 else None
    args = ["find-batch", str(run), "--json", "--max", "8" if ctx.smoke else "256", "--timeout", "120", *eager]
    if ctx.smoke:
        args += ["--max-memory", "4GiB"]  # tiny: the memory model's guess is capped at --max, one trial
    start = time.perf_counter()
    code, stdout = run_nanopt(*args)
    seconds = time.perf_counter() - start
    record = base_record(ctx, "find-batch:gpt2-small", shlex.join(["nanopt", "find-batch", "runs/gpt2-small",
                                                                   *args[2:]]))
    record.update(seconds=round(seconds, 2), micro_batch=None, predicted_micro_batch=predicted, compile=False,
                  status="ok" if code == 0 else f"failed (exit {code})")
    if code == 0:
        found = json.loads(stdout)
        (ctx.out / "find_batch.json").write_text(json.dumps(found, indent=2))
        fitting = [t for t in found.get("trials", []) if t.get("fits")]
        at_max = max(fitting, key=lambda t: t["micro_batch_size"], default={})
        calibration = found.get("calibration") or {}
        record.update(micro_batch=found.get("max_micro_batch"), best_micro_batch=found.get("best_micro_batch"),
                      tokens_per_s=at_max.get("tokens_per_s"), mfu=at_max.get("mfu"),
                      peak_memory_gib=gib(calibration.get("measured_peak_bytes")),
                      predicted_memory_gib=gib(calibration.get("predicted_peak_bytes")),
                      peak_error=calibration.get("peak_error"), trials=len(found.get("trials", [])),
                      search_complete=found.get("search_complete"))
    append_record(ctx.out, record)


def _this_gpu() -> str:
    """`nanopt estimate --gpu` for the device this session runs on (its default is an H100 SXM)."""
    import torch

    from nanopt.hardware import detect_gpu

    if not torch.cuda.is_available():
        return "cpu"
    gpu = detect_gpu(torch.cuda.get_device_name(0))
    return gpu.key if gpu is not None else "h100-sxm"


# ------------------------------------------------------------------------------------ step: bf16 vs fp32


# The agreement bf16 + compile must show with fp32 eager over the same steps and data (see bench/RESULTS.md):
# bf16 rounds each matmul input to 8 bits of mantissa (relative 2^-8 = 0.4%), so the two runs follow slightly
# different trajectories; what must agree is the curve, not each step.
EARLY_STEPS = 10  # the first steps: the two runs are still nearly the same model
EARLY_ABS_TOL = 0.05  # nats per step
LATE_REL_TOL = 0.02  # mean loss over the last fifth of the steps, relative


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


def _train_losses(run: Path) -> dict[int, float]:
    """Each logged step's training loss; after a resume, the resumed session's (the later line)."""
    return {int(r["step"]): float(r["loss"]) for r in _read_jsonl(run / "metrics.jsonl")
            if r.get("kind") == "train" and r.get("loss") is not None}


def step_bf16_vs_fp32(ctx: Context) -> None:
    """GPT-2 small on the built-in corpus, the same seed and data: bf16 + compile against fp32 eager."""
    steps = 8 if ctx.smoke else 200
    micro = 2 if ctx.smoke else 8
    source = _preset(ctx, "gpt2-small")
    seq = _seq(source)
    settings = [f"max_steps={steps}", "train_tokens=null", f"micro_batch_size={micro}",
                f"global_batch_tokens={micro * seq}", f"warmup_steps={min(10, steps // 2)}", f"eval_interval={steps}",
                "eval_tokens=" + str(2 * micro * seq), f"checkpoint_interval={steps}"]
    sides = {"bf16": ["precision=bf16", f"compile={'false' if ctx.smoke else 'true'}"],
             "fp32": ["precision=fp32", "compile=false"]}
    losses, recompiles, seconds, commands = {}, {}, {}, []
    for side, extra in sides.items():
        run = ctx.work / "runs" / f"bf16-vs-fp32-{side}"
        run.mkdir(parents=True, exist_ok=True)
        for name in ("model.json", "train.json"):
            (run / name).write_text((source / name).read_text())
        args = ["train", str(run), "--resume", "none", "--no-live", *[a for s in settings + extra
                                                                       for a in ("--set", s)]]
        commands.append(shlex.join(["nanopt", *args]))
        start = time.perf_counter()
        code, output = fork_nanopt(args, run / "output.txt", log_recompiles=True)
        seconds[side] = round(time.perf_counter() - start, 2)
        if code != 0:
            raise SystemExit(f"{side} training failed (exit {code})")
        losses[side] = _train_losses(run)
        recompiles[side] = output.count("Recompiling")
    record = base_record(ctx, "bf16-vs-fp32:gpt2-small", " && ".join(commands))
    record.update(steps=steps, micro_batch=micro, seq_len=seq, seconds=seconds, recompiles=recompiles,
                  **compare_curves(losses["bf16"], losses["fp32"]),
                  final_loss={side: curve[max(curve)] if curve else None for side, curve in losses.items()})
    if not record["within_tolerance"]:
        record["status"] = "outside tolerance"
    append_record(ctx.out, record)
    print(json.dumps({k: record[k] for k in ("recompiles", "early_max_abs_diff", "late_rel_diff",
                                             "within_tolerance") if k in record}), flush=True)


# ------------------------------------------------------------------------------------------- step: resume


def _resume_run(ctx: Context, name: str, steps: int, interval: int, micro: int) -> tuple[Path, list[str]]:
    """A GPT-2 small run directory checkpointing every `interval` steps, and the `nanopt train` arguments for it."""
    source = _preset(ctx, "gpt2-small")
    run = ctx.work / "runs" / name
    run.mkdir(parents=True, exist_ok=True)
    for file in ("model.json", "train.json"):
        (run / file).write_text((source / file).read_text())
    settings = [f"max_steps={steps}", "train_tokens=null", f"micro_batch_size={micro}",
                f"global_batch_tokens={micro * _seq(source)}", f"warmup_steps={interval}",
                f"checkpoint_interval={interval}", f"eval_interval={steps}", f"eval_tokens={2 * micro * _seq(source)}"]
    if ctx.smoke:
        settings.append("compile=false")
    return run, ["train", str(run), "--no-live", *[a for s in settings for a in ("--set", s)]]


def _last_logged_step(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    steps = [int(r["step"]) for r in _read_jsonl(metrics) if r.get("kind") == "train"] if metrics.exists() else []
    return max(steps, default=0)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by the kill
    return records


def step_resume(ctx: Context) -> None:
    """A run killed (SIGKILL) one step after its second checkpoint began, resumed with `--resume auto` (from the
    newest complete checkpoint), against the same run uninterrupted: the curve after the resume must continue the
    uninterrupted one."""
    steps, interval, micro = (20, 4, 2) if ctx.smoke else (60, 15, 8)
    reference, args = _resume_run(ctx, "resume-reference", steps, interval, micro)
    code, _ = fork_nanopt([*args, "--resume", "none"], reference / "output.txt")
    if code != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {code})")
    killed, args = _resume_run(ctx, "resume-killed", steps, interval, micro)
    kill_after = 2 * interval + 1  # the first checkpoint is surely complete by then
    # Accumulation 1 on one rank: batch N is step N's, so the kill lands as step kill_after + 1 begins.
    pid = start_nanopt([*args, "--resume", "none"], killed / "output.txt", kill_at_batch=kill_after + 1)
    _, status = os.waitpid(pid, 0)
    finished_first = os.waitstatus_to_exitcode(status) != -signal.SIGKILL
    killed_after = _last_logged_step(killed) if finished_first else kill_after
    print(f"killed after step {killed_after}", flush=True)
    code, _ = fork_nanopt([*args, "--resume", "auto"], killed / "output.txt")
    if code != 0:
        raise SystemExit(f"the resumed run failed (exit {code})")
    resumes = [r for r in _read_jsonl(killed / "metrics.jsonl") if r.get("event") == "resume"]
    resumed_from = int(resumes[-1]["step"]) if resumes else 0
    ours, theirs = _train_losses(killed), _train_losses(reference)
    after = [step for step in sorted(theirs) if step > resumed_from and step in ours]
    diff = max((abs(ours[step] - theirs[step]) for step in after), default=None)
    train = shlex.join(["nanopt", "train", "runs/gpt2-small", *args[2:]])
    record = base_record(ctx, "resume:gpt2-small", f"{train} --resume none; kill -9 after step {kill_after}; "
                                                   f"{train} --resume auto")
    record.update(steps=steps, checkpoint_interval=interval, micro_batch=micro, killed_after_step=killed_after,
                  resumed_from=resumed_from, compared_steps=len(after), max_abs_diff_after_resume=diff,
                  tolerance=EARLY_ABS_TOL)
    if finished_first:
        record["status"] = "not killed: the run finished first"
    elif resumed_from == 0 or diff is None or diff > EARLY_ABS_TOL or len(after) != steps - resumed_from:
        record["status"] = "resume does not continue the curve"
    append_record(ctx.out, record)
    print(json.dumps({k: record[k] for k in ("resumed_from", "compared_steps", "max_abs_diff_after_resume",
                                             "status")}), flush=True)


# ------------------------------------------------------------------------------------------ step: profile


def step_profile(ctx: Context) -> None:
    """`nanopt profile` of GPT-2 small: the category table (matmul, attention, optimizer, data wait)."""
    run = _preset(ctx, "gpt2-small")
    micro = 2 if ctx.smoke else 16
    args = ["profile", str(run), "--json", "--no-tensorboard", "--out", str(ctx.work / "profile"),
            "--set", f"micro_batch_size={micro}", "--set", f"global_batch_tokens={micro * 2 * _seq(run)}"]
    code, stdout = run_nanopt(*args)
    record = base_record(ctx, "profile:gpt2-small", shlex.join(["nanopt", "profile", "runs/gpt2-small", *args[2:]])
                         .replace(str(ctx.work / "profile"), "OUT/profile"))
    if code != 0:
        record["status"] = f"failed (exit {code})"
        append_record(ctx.out, record)
        return
    summary = json.loads(stdout)
    (ctx.out / "profile.json").write_text(json.dumps(summary, indent=2))
    shares = {c["category"]: round(c["share"], 4) for c in summary.get("categories", [])}
    record.update(tokens_per_s=summary.get("tokens_per_s"), mfu=summary.get("mfu"),
                  peak_memory_gib=gib(summary.get("peak_memory_bytes")), micro_batch=micro,
                  categories=shares, data_wait_share=summary.get("data_wait_share"),
                  idle_share=summary.get("idle_share"), compile=summary.get("compile"),
                  top_ops=[op["name"] for op in summary.get("top_ops", [])[:10]])
    append_record(ctx.out, record)


def _seq(run: Path) -> int:
    train = json.loads((run / "train.json").read_text())
    return train.get("seq_len") or json.loads((run / "model.json").read_text())["max_position_embeddings"]


# ---------------------------------------------------------------------------------------- step: gpu tests


def gpu_test_files() -> list[str]:
    """The test files with GPU-marked tests: collecting only them keeps the step short and spares the GPU
    machine the imports of every other test module (hypothesis, for one, is not installed there)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def step_gpu_tests(ctx: Context) -> None:
    """The GPU-marked tests (pytest -m gpu); in a smoke run one file, to show the step works."""
    import importlib.util

    target = ["tests/test_gpu_table.py"] if ctx.smoke else gpu_test_files()
    record = base_record(ctx, "gpu-tests", "python -m pytest -m gpu -q " + " ".join(target))
    if importlib.util.find_spec("pytest") is None:
        record["status"] = "pytest not importable: carry build/gpu-pylib (bench/RESULTS.md, GPU session)"
        append_record(ctx.out, record)
        raise SystemExit(record["status"])
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-ra", "-p", "no:cacheprovider",
            *target]
    report = ctx.out / "gpu_tests.txt"
    with open(report, "w") as f:  # written as the tests run: a step killed at its budget leaves what ran
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())
    output = report.read_text(errors="replace")
    counts = {key: 0 for key in ("passed", "failed", "skipped", "deselected", "error")}
    # pytest's last line: "2 passed, 1 skipped, 500 deselected in 3.1s"
    summaries = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected)",
                                                                        line)]
    summary = summaries[-1].strip("= ") if summaries else output.strip()[-200:]
    print(summary, flush=True)
    for count, key in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", summary):
        counts[key] = int(count)
    record.update(exit_code=done.returncode, summary=summary, **counts,
                  status="ok" if done.returncode in (0, 5) else f"failed (exit {done.returncode})")
    append_record(ctx.out, record)


WORKERS: dict[str, Callable[[Context], None]] = {
    "env": step_env,
    "throughput-gpt2": lambda ctx: step_throughput(ctx, "gpt2-small", wanted_micro=32, accum_cap=16, timed_micro=32),
    "throughput-llama": lambda ctx: step_throughput(ctx, "llama-1b", wanted_micro=8, accum_cap=8, timed_micro=16),
    "memory": step_memory,
    "data": step_data,
    "find-batch": step_find_batch,
    "bf16-vs-fp32": step_bf16_vs_fp32,
    "profile": step_profile,
    "gpu-tests": step_gpu_tests,
    "resume": step_resume,
}


# --------------------------------------------------------------------------------------------- the parent


def read_commit(given: str | None) -> str:
    """--commit, else `git rev-parse`, else .git/HEAD read by hand (a copied tree may have no git), else unknown."""
    if given:
        return given
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    head = REPO / ".git" / "HEAD"
    try:
        text = head.read_text().strip()
        if text.startswith("ref: "):
            ref = REPO / ".git" / text[5:]
            return ref.read_text().strip()[:7] if ref.exists() else "unknown"
        return text[:7] or "unknown"
    except OSError:
        return "unknown"


def _log(out: Path, text: str) -> None:
    with open(out / LOG, "a") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    print(text.rstrip("\n"), flush=True)


def _records_per_workload(out: Path) -> dict[str, int]:
    path = out / RESULTS
    counts: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                workload = json.loads(line)["workload"]
                counts[workload] = counts.get(workload, 0) + 1
    return counts


def _record_outcome(ctx: Context, step: Step, status: str) -> None:
    """A step that did not finish: one record per workload saying so, beside any it measured before (their count
    in `records_before`), so that nothing a user looks for is silently absent or silently partial."""
    counts = _records_per_workload(ctx.out)
    for workload in step.workloads:
        record = _plain_record(ctx, workload, f"python bench/gpu_session.py --only {step.name}", status)
        record["records_before"] = counts.get(workload, 0)
        append_record(ctx.out, record)


def _plain_record(ctx: Context, workload: str, command: str, status: str) -> dict[str, Any]:
    """base_record without importing torch in the parent (which only schedules and kills)."""
    record = {key: None for key in REQUIRED_KEYS}
    record.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), gpu=ctx.gpu,
                  torch=_torch_version(), commit=ctx.commit, command=command, workload=workload, status=status)
    return record


def gpu_name_from_smi() -> str | None:
    """The first GPU's name as nvidia-smi gives it (what torch.cuda.get_device_name says too), None without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines() if done.returncode == 0 else []
    return names[0].strip() if names else None


def _torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 (any failure: unknown)
        return None


def preload() -> None:
    """Import torch and nanopt's training path once, so that each forked step starts in milliseconds instead of
    seconds. Importing initializes no CUDA (the parent must never touch the device: a forked child could then not
    use it)."""
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
    import bench_train  # noqa: F401  (torch, the model, the step, the baseline)
    import torch

    import nanopt.cli  # noqa: F401

    if torch.cuda.is_initialized():  # an import touched the device: forked steps could not use it
        raise RuntimeError("CUDA was initialized while importing; run with --isolation spawn")


def _start_forked(ctx: Context, step: Step) -> int:
    """The step in a forked child, its own session (so killing its group ends what it started too)."""
    return _forked(ctx.out / LOG, lambda: WORKERS[step.name](ctx), new_session=True)


def _start_spawned(ctx: Context, step: Step) -> int:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", step.name, "--out", str(ctx.out),
            "--work", str(ctx.work), "--commit", ctx.commit] + (["--smoke"] if ctx.smoke else [])
    with open(ctx.out / LOG, "a") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=child_env(),
                                start_new_session=True).pid


def _wait(pid: int, budget: float) -> int | None:
    """The child's exit status, or None when it was killed (with its whole group) at the end of its budget."""
    deadline = time.perf_counter() + budget
    while time.perf_counter() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # a forked child killed before its setsid() has no group of its own yet
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_step(ctx: Context, step: Step, budget: float, isolation: str) -> str:
    """The step in its own process group, killed with everything it started when its budget runs out."""
    _log(ctx.out, f"\n=== {step.name} (budget {budget:.0f} s) ===")
    start = time.perf_counter()
    pid = _start_forked(ctx, step) if isolation == "fork" else _start_spawned(ctx, step)
    code = _wait(pid, budget)
    status = f"timed out after {budget:.0f} s" if code is None else "ok" if code == 0 else f"failed (exit {code})"
    _log(ctx.out, f"=== {step.name}: {status} in {time.perf_counter() - start:.1f} s ===")
    if status != "ok":
        _record_outcome(ctx, step, status)
    return status


def run_session(ctx: Context, steps: list[Step], total_budget: float, budgets: dict[str, float],
                isolation: str = "fork") -> dict[str, str]:
    deadline = time.perf_counter() + total_budget
    outcome: dict[str, str] = {}
    for step in steps:
        left = deadline - time.perf_counter()
        wanted = budgets.get(step.name, SMOKE_STEP_BUDGET_S if ctx.smoke else step.gpu_budget_s)
        if step.needs_data and outcome.get("data", "ok") != "ok":
            outcome[step.name] = "skipped: the data step failed"
        elif left < min(step.min_s, wanted):
            outcome[step.name] = f"skipped: {left:.0f} s left of the session's budget"
        else:
            outcome[step.name] = run_step(ctx, step, min(wanted, left), isolation)
            continue
        _log(ctx.out, f"=== {step.name}: {outcome[step.name]} ===")
        _record_outcome(ctx, step, outcome[step.name])
    return outcome


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


def select_steps(only: str | None) -> list[Step]:
    if not only:
        return list(STEPS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise ValueError(f"--only: unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    if any(s.needs_data for s in STEPS if s.name in names):
        names.append("data")  # their dataset lives in this session's scratch folder: tokenize it again
    return [s for s in STEPS if s.name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (created; results are appended)")
    parser.add_argument("--commit", help="the commit measured (default: git, else .git/HEAD, else unknown)")
    parser.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny shapes, a few steps")
    parser.add_argument("--only", help=f"comma-separated steps to run, in this order: {','.join(STEP_NAMES)}")
    parser.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                        help="override one step's wall-clock budget (repeatable)")
    parser.add_argument("--total-budget", type=float, default=None,
                        help=f"seconds for the whole session (default {SESSION_BUDGET_S:.0f}; "
                             f"smoke {SMOKE_SESSION_BUDGET_S:.0f})")
    parser.add_argument("--isolation", choices=["fork", "spawn"], default="fork",
                        help="fork: each step forked from a process that imported torch once (fast); spawn: each "
                             "step a fresh interpreter (the fallback should forking misbehave)")
    parser.add_argument("--worker", choices=STEP_NAMES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # the CPU even on a GPU host: tiny shapes, and the same records wherever the suite runs
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    commit = read_commit(args.commit)
    if args.worker:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        ctx = Context(out=args.out.resolve(), work=args.work, smoke=args.smoke, commit=commit)
        WORKERS[args.worker](ctx)
        return 0
    try:
        steps, budgets = select_steps(args.only), parse_budgets(args.budget)
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    total = args.total_budget or (SMOKE_SESSION_BUDGET_S if args.smoke else SESSION_BUDGET_S)
    if args.isolation == "fork":
        preload()
    with tempfile.TemporaryDirectory(prefix="gpu-session-") as work:
        ctx = Context(out=args.out.resolve(), work=Path(work), smoke=args.smoke, commit=commit,
                      gpu=None if args.smoke else gpu_name_from_smi())
        _log(ctx.out, f"gpu_session: commit {commit}, {'smoke' if args.smoke else 'GPU'}, steps "
                      f"{','.join(s.name for s in steps)}, budget {total:.0f} s")
        outcome = run_session(ctx, steps, total, budgets, args.isolation)
    _log(ctx.out, "summary: " + json.dumps(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main())
