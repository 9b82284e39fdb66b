"""The GPU readiness review's dry-run checklist, beside the smoke run of tests/test_gpu_session.py: the plans fit
one call with every compile budgeted, a step over its budget is killed with what it started, the call's own
timeout still leaves records and a summary, the parent never touches CUDA before forking, the compiled training
graph is whole (the Hopper branch included), the throughput shapes fit an H100 and an H200, and the commit and
output folder are what a copied tree without .git needs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from clihelp import REPO

sys.path.insert(0, str(REPO / "bench"))

from gpusession import records  # noqa: E402
from gpusession.plan import (  # noqa: E402
    COMPILE_S,
    GPU_PLANS,
    PLANS,
    SESSION_BUDGET_S,
    Step,
    graphs_over_budget,
    plan_problems,
    step_budget,
    step_named,
)
from gpusession.session import resolve_out  # noqa: E402
from gpusession.training import compare_curves, resume_figures  # noqa: E402

SCRIPT = REPO / "bench" / "gpu_session.py"
H100_BYTES, H200_BYTES = 81559 << 20, 143771 << 20  # what nvidia-smi reports on each card


# ------------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize("plan", GPU_PLANS)
def test_each_windows_plan_fits_one_call_with_every_compile_budgeted(plan: str):
    steps = [step_named(name) for name in PLANS[plan]]
    assert sum(s.budget_s for s in steps) <= SESSION_BUDGET_S, plan_problems(steps, SESSION_BUDGET_S)
    assert plan_problems(steps, SESSION_BUDGET_S) == []
    assert steps[0].name == "preflight" and steps[-1].name == "gpu-tests"  # fail fast; the open-ended step last
    assert all(s.budget_s == sum(COMPILE_S[k] for k in s.compiles) + s.work_s for s in steps)
    one_more_compile = [*steps, Step("extra", ("extra",), ("cold",), 0, 0)]
    if sum(s.budget_s for s in steps) + COMPILE_S["cold"] > SESSION_BUDGET_S:
        assert "add up to" in plan_problems(one_more_compile, SESSION_BUDGET_S)[0]


def test_a_step_compiling_more_graphs_than_its_budget_counts_is_named():
    throughput = step_named("throughput-gpt2")
    assert graphs_over_budget(throughput, 2) is None and graphs_over_budget(throughput, None) is None
    problem = graphs_over_budget(throughput, 3)
    assert "throughput-gpt2 compiled 3 graph(s), its budget counts 2" in problem
    assert graphs_over_budget(step_named("gpu-tests"), 9) is None  # pytest's processes: not countable


def test_unspent_time_goes_to_the_next_step_but_never_into_time_promised_to_later_ones():
    step = step_named("memory")
    assert (step.budget_s, step.min_s) == (15, 10)
    assert step_budget(step, left_s=300, planned_after_s=200, smoke=False, overrides={}) == 100
    assert step_budget(step, left_s=230, planned_after_s=200, smoke=False, overrides={}) == 30
    assert step_budget(step, left_s=12, planned_after_s=200, smoke=False, overrides={}) == 12  # what is left
    assert step_budget(step, left_s=5, planned_after_s=0, smoke=False, overrides={}) is None  # under its minimum
    assert step_budget(step, left_s=300, planned_after_s=0, smoke=False, overrides={"memory": 7}) == 7  # exact


@pytest.mark.parametrize("device_bytes", [H100_BYTES, H200_BYTES], ids=["h100", "h200"])
def test_the_throughput_shapes_fit_an_h100_and_an_h200(device_bytes: int, tmp_path: Path):
    from gpusession.throughput import throughput_plan

    from nanopt.config import load_run

    ctx = records.Context(out=tmp_path, work=tmp_path, smoke=False, commit="test")
    from nanopt.model.memory import estimate_memory

    gpt2_run = load_run(REPO / "runs/gpt2-small")
    gpt2 = throughput_plan(ctx, gpt2_run, 32, 16, 32, device_bytes, True, "bf16")
    llama = throughput_plan(ctx, load_run(REPO / "runs/llama-3.2-1b"), 8, 8, 16, device_bytes, True, "bf16")
    assert (gpt2.micro_batch, gpt2.accums, llama.micro_batch, llama.accums) == (32, [1, 16], 8, [1, 8])
    # throughput-gpt2-64 keeps both sides for two rounds: nanopt's predicted peak plus the baseline's, scaled by
    # what the first H100 window measured at 32 (baseline 17.42 GiB against nanopt's 13.78), fit the card.
    at_64 = throughput_plan(ctx, gpt2_run, 64, 16, 32, device_bytes, True, "bf16")
    predicted = estimate_memory(gpt2_run.model, gpt2_run.seq_len, precision="bf16", compiled=True,
                                activation_checkpointing=False, parallelism="ddp", world_size=1,
                                optimizer="adamw").total(64)
    assert at_64.micro_batch == 64 and predicted * (1 + 17.42 / 13.78) < 0.95 * device_bytes


def test_the_throughput_step_times_the_accumulation_training_runs_at(tmp_path: Path, tiny_dataset: Path):
    # GPT-2 small's preset trains 0.5M-token steps: 16 micro-batches of 32 x 1024. The first two GPU windows timed
    # accumulation 1 only, because the plan read the global batch after it had been cut to one micro-batch.
    from gpusession.throughput import _setup

    ctx = records.Context(out=tmp_path, work=tmp_path, smoke=False, commit="test")
    shutil.copytree(tiny_dataset, ctx.data)
    bench = _setup(ctx, "gpt2-small", "gpt2-small", 32, 16, 32)
    assert (bench.plan.micro_batch, bench.plan.accums, bench.plan.preset_accum) == (32, [1, 16], 16)
    assert bench.run.train.micro_batch_size == 32 and bench.run.train.compile is True


# ------------------------------------------------------------------------------------ processes and kills


HARNESS = r"""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from gpusession import records, session, steps
from gpusession.plan import step_named

def sleepy(ctx):  # a step that hangs, with a process of its own that must die with it
    child = subprocess.Popen(["sleep", "120"])
    (ctx.out / "grandchild.pid").write_text(str(child.pid))
    time.sleep(120)

def quick(ctx):
    records.append_record(ctx.out, records.plain_record(ctx, "memory:gpt2-small", "quick", "ok"))

def broken(ctx):
    raise RuntimeError("no CUDA here")

steps.WORKERS.update(data=sleepy, memory=quick, preflight=broken)
out, mode = Path(sys.argv[1]), sys.argv[4]
if mode == "main":  # the whole call, ended by SIGTERM as `timeout 590` ends it
    sys.exit(session.main(["--out", str(out), "--smoke", "--only", "data", "--isolation", "fork"]))
ctx = records.Context(out=out, work=out / "work", smoke=False, commit="test")
names = ["preflight", "memory"] if mode == "fatal" else ["data", "memory"]
outcome, problems = session.run_session(ctx, [step_named(n) for n in names], 60, {"data": 1.5}, "fork",
                                        session.Tail(out / "results.jsonl"))
print("OUTCOME " + json.dumps(outcome))
"""


def _harness(tmp_path: Path, mode: str) -> tuple[list[str], Path]:
    out = tmp_path / "out"
    out.mkdir()
    return [sys.executable, "-c", HARNESS, str(out), str(REPO / "bench"), str(REPO), mode], out


def _dead(pid: int) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow  # the GPU window's harness, not a command: CI's slow set runs it
def test_a_step_over_its_budget_is_killed_with_what_it_started_recorded_and_the_next_runs(tmp_path: Path):
    argv, out = _harness(tmp_path, "steps")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.split("OUTCOME ", 1)[1])
    assert outcome == {"data": "timed out after 2 s", "memory": "ok"}
    assert _dead(int((out / "grandchild.pid").read_text()))
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["workload"], r["status"]) for r in lines] == [
        ("tokenize:stdlib", "timed out after 2 s"), ("step:data", "timed out after 2 s"),
        ("memory:gpt2-small", "ok"), ("step:memory", "ok")]
    assert lines[0]["records_before"] == 0 and lines[1]["budget_s"] == 1.5
    assert "R tokenize:stdlib [timed out after 2 s]" in done.stdout and "R memory:gpt2-small [ok]" in done.stdout


def test_a_failed_preflight_stops_the_call(tmp_path: Path):
    argv, out = _harness(tmp_path, "fatal")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    outcome = json.loads(done.stdout.split("OUTCOME ", 1)[1])
    assert outcome == {"preflight": "failed (exit 1)", "memory": "skipped: preflight failed"}
    assert "RuntimeError: no CUDA here" in done.stdout  # the reason, in stdout's tail too
    statuses = [(r["workload"], r["status"]) for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())]
    assert ("step:memory", "skipped: preflight failed") in statuses


@pytest.mark.slow  # the GPU window's harness, not a command: CI's slow set runs it
def test_the_calls_timeout_kills_the_step_and_still_prints_records_and_the_summary(tmp_path: Path):
    argv, out = _harness(tmp_path, "main")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in process.stdout:  # the step has started once its banner is out
        seen.append(line)
        if line.startswith("=== data (budget"):
            break
    deadline = time.monotonic() + 60
    while not (out / "grandchild.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=60)
    stdout = "".join(seen) + rest
    assert process.returncode == 124, stdout[-3000:]
    assert "R step:data [killed by the call's timeout]" in stdout and "= summary =" in stdout
    assert _dead(int((out / "grandchild.pid").read_text()))


FORK_PROBE = r"""
import importlib, sys
import torch

def refuse(name):
    def call(*args, **kwargs):
        raise AssertionError(f"the parent touched CUDA: torch.cuda.{name}")
    return call

for name in ("is_available", "device_count", "get_device_name", "get_device_properties", "get_device_capability",
             "init", "_lazy_init", "mem_get_info", "synchronize", "set_device", "current_device"):
    setattr(torch.cuda, name, refuse(name))
if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build (on a CPU build, adding it would fake one)
    torch._C._cuda_getDeviceCount = refuse("_cuda_getDeviceCount")
sys.path[:0] = sys.argv[1:]
from gpusession import session
session.preload()
for name in ("nanopt.cli", "nanopt.train.loop", "torch._dynamo", "typer._adapters", "nanopt.data.loaders.loader",
             "nanopt.model.transformer", "nanopt.train.guard.exit_hook", "matplotlib.figure",
             "matplotlib.backends.backend_agg", "faulthelp"):
    importlib.import_module(name)  # what tests/faulthelp.py's launcher imports before it forks the GPU tests
assert not torch.cuda.is_initialized()
print("no CUDA call")
"""


@pytest.mark.slow  # the GPU window's harness, not a command: CI's slow set runs it
def test_the_parent_and_the_test_launcher_import_everything_without_touching_cuda():
    done = subprocess.run([sys.executable, "-c", FORK_PROBE, str(REPO / "bench"), str(REPO), str(REPO / "tests")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})
    assert done.returncode == 0 and "no CUDA call" in done.stdout, done.stderr[-3000:]


def test_records_never_initialize_cuda_and_no_nanopt_is_forked_after_it(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path):
    """bf16-vs-fp32 records its first side before it forks the second: a record that initialized CUDA there would
    leave the second side without a GPU (a forked child cannot use CUDA its parent initialized)."""
    from gpusession import isolation

    def refuse(*args, **kwargs):
        raise AssertionError("a record initialized CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", refuse)
    monkeypatch.setattr(torch.cuda, "_lazy_init", refuse)
    ctx = records.Context(out=tmp_path, work=tmp_path, smoke=False, commit="test", gpu="NVIDIA H100 80GB HBM3")
    assert records.base_record(ctx, "gpt2-small", "test")["gpu"] == "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="after initializing CUDA"):
        isolation.start_nanopt(["--version"], tmp_path / "output.txt")
    assert not (tmp_path / "output.txt").exists()  # nothing was forked


# --------------------------------------------------------------------------------------- the compiled graph


def _tiny_model(architecture: str = "llama"):
    from faulthelp import TINY_MODEL

    from nanopt.config import ModelConfig
    from nanopt.model.transformer import Transformer

    cfg = ModelConfig(**{**TINY_MODEL, "architecture": architecture, "vocab_size": 64, "num_key_value_heads": 1})
    model = Transformer(cfg)
    model.loss_chunk_rows = 8  # several chunks, the last ragged: the chunked loss a GPU shape takes
    return model, torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))


def test_the_training_graph_is_whole_under_bf16_with_cudnn_attention_and_eval_adds_exactly_one():
    from torch._dynamo.utils import counters

    model, ids = _tiny_model()
    model.prefer_cudnn_attention(True)  # the sdpa_kernel(..., set_priority=True) branch a Hopper card takes
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(ids[:, :-1], ids[:, 1:])  # an evaluation: the grad-mode guard fails once
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def test_the_hopper_branch_traces_whole(monkeypatch: pytest.MonkeyPatch):
    from nanopt.model import transformer

    asked = []

    def hopper(index=None):
        asked.append(index)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", hopper)
    monkeypatch.setattr(transformer, "cudnn_attention_by_default", lambda device: transformer._is_hopper(device.index))
    model, ids = _tiny_model("gpt2")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert asked and torch.isfinite(loss)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------- commit, OUT, options


def test_the_commit_comes_from_bench_commit_and_unknown_is_said_loudly(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    monkeypatch.setattr(records, "REPO", tree)
    monkeypatch.setattr(records, "COMMIT_FILE", tree / "bench" / "COMMIT")
    commit, source = records.read_commit(None)
    assert commit == "unknown" and "WARNING" in source and "git rev-parse --short HEAD > bench/COMMIT" in source
    (tree / "bench" / "COMMIT").write_text("c0ffee1\n")
    assert records.read_commit(None) == ("c0ffee1", "bench/COMMIT")
    assert records.read_commit("abc1234") == ("abc1234", "--commit")
    (tree / ".git").mkdir()
    (tree / ".git" / "HEAD").write_text("0123456789abcdef0123456789abcdef01234567\n")  # a tree that moved on
    commit, source = records.read_commit(None)
    assert commit == "c0ffee1" and "WARNING" in source and "0123456" in source
    (tree / "bench" / "COMMIT").write_text("$(git rev-parse --short HEAD)\n")  # never a shell's leftovers
    assert records.read_commit(None) == ("0123456", "git")


def test_out_defaults_to_dollar_out_and_a_relative_folder_that_is_not_it_is_refused(tmp_path: Path):
    assert resolve_out(None, {"OUT": "/gpu/out"}) == Path("/gpu/out")
    assert resolve_out(Path("rel"), {"OUT": "rel"}) == Path("rel")
    assert resolve_out(Path("/abs"), {}) == Path("/abs")
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    for argv, fragment in ((["--out", "results"], "relative folder"), ([], "no output folder")):
        done = subprocess.run([sys.executable, str(SCRIPT), *argv, "--smoke"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and fragment in done.stderr and "Traceback" not in done.stderr
        assert not any(tmp_path.iterdir())


def test_a_bad_budget_is_refused_before_anything_runs(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--smoke",
                           "--budget", "warp-drive=10"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "warp-drive" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_loss_curves_outside_the_tolerance_are_flagged():
    fp32 = {step: 7.0 - 0.01 * step for step in range(1, 101)}
    assert compare_curves(dict(fp32), fp32)["within_tolerance"] is True
    drifted = {step: loss * 1.05 if step > 80 else loss for step, loss in fp32.items()}
    assert compare_curves(drifted, fp32)["within_tolerance"] is False
    early_jump = {step: loss + (0.2 if step == 3 else 0.0) for step, loss in fp32.items()}
    assert compare_curves(early_jump, fp32)["within_tolerance"] is False



def test_resume_figures_tell_a_faulty_restore_from_gpu_run_to_run_drift():
    # The second GPU window: two identical runs drift apart (atomic adds in the backward), so the resumed curve
    # cannot be judged against the uninterrupted one alone. Its first step, against the killed run's own loss at
    # that step (same weights, optimizer state and batch), is what says the restore was exact.
    reference = {1: 7.0, 2: 6.5, 3: 6.2, 4: 6.0, 5: 5.9, 6: 5.8}
    killed = {1: 7.0, 2: 6.5, 3: 6.201, 4: 6.004}  # drifting from the reference before any resume
    drifting = resume_figures({3: 6.201, 4: 6.0041, 5: 5.91, 6: 5.81}, reference, killed, resumed_from=2)
    assert drifting["first_step_diff"] == 0.0 and drifting["max_abs_diff_replayed"] < 1e-3
    assert abs(drifting["nondeterminism_floor"] - 0.004) < 1e-9
    assert abs(drifting["max_abs_diff_after_resume"] - 0.01) < 1e-9
    faulty = resume_figures({3: 6.3, 4: 6.1, 5: 5.95, 6: 5.85}, reference, killed, resumed_from=2)
    assert abs(faulty["first_step_diff"] - 0.099) < 1e-9  # e.g. the wrong batch, or an optimizer state lost
