"""The GPU session's exact command line, in its CPU smoke mode, run the way the GPU machine runs it: `bash
bench/gpu_session.sh --smoke` in a copy of the tree WITHOUT .git (the commit comes from bench/COMMIT), `python3`
found on PATH (PYTHON unset), OUT set and no --out, `import datasets` failing, and no network where `unshare -rn`
works here. So the one command a GPU window runs cannot rot between the rare windows. One run serves every check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from clihelp import REPO

sys.path.insert(0, str(REPO / "bench"))

from gpusession.plan import PLANS, STEPS  # noqa: E402
from gpusession.records import REQUIRED_KEYS, headline  # noqa: E402

# The whole session's smoke run (every step, about a minute): CI's slow stage runs it on every change.
pytestmark = pytest.mark.slow

COMMIT = "c0ffee1"
WORKLOADS = ("preflight", "tokenize:stdlib", "gpt2-small", "memory:gpt2-small", "memory:llama-1b",
             "find-batch:gpt2-small", "bf16-vs-fp32:gpt2-small", "profile:gpt2-small", "gpu-tests", "llama-1b",
             "resume:gpt2-small", "fp8:gpt2-small", "profile:llama-1b", "gpt2-small:micro64", "muon:gpt2-small",
             "health:gpt2-small", "muon-step:gpt2-small", "find-batch-compiled:gpt2-small", "llama-1b:fp8",
             "gpt2-small:stacked", "gpt2-small:graphs", "residual:gpt2-small", "plan:gpt2")
OUT_FILES = {"results.jsonl", "session.log", "env.txt", "find_batch.json", "profile.json", "profile_llama.json",
             "gpu_tests.txt"}
MAX_OUT_FILES = 8  # what comes back from the GPU machine


def shipped_files() -> list[Path]:
    """What the GPU machine receives: tracked files and untracked ones git does not ignore (never .git itself)."""
    done = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True)
    if done.returncode == 0:
        return [Path(name) for name in done.stdout.decode().split("\0") if name]
    skip = {".git", ".venv", "build", "data", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [p.relative_to(REPO) for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


def copy_without_git(dest: Path) -> Path:
    for name in shipped_files():
        source = REPO / name
        if source.is_file() and name.parts[0] != ".git":
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / "bench" / "COMMIT").write_text(COMMIT + "\n")  # what `git rev-parse --short HEAD > bench/COMMIT` wrote
    return dest


def no_network_prefix() -> list[str]:
    """`unshare -rn` (a network namespace with no interfaces) where this machine allows it; else nothing."""
    if shutil.which("unshare") is None:
        return []
    works = subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0
    return ["unshare", "-rn"] if works else []


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("gpu-session")
    tree = copy_without_git(root / "tree")
    blocker = root / "no_datasets"
    blocker.mkdir()
    # Neither `datasets` nor torchao is on the GPU machine.
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['datasets'] = sys.modules['torchao'] = None\n")
    bin_dir = root / "bin"  # `python3` is this interpreter (a venv's python must be run by its own path)
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    unset = ("PYTHON", "OUT", "PYTHONPATH", "PYTORCH_ALLOC_CONF", "TORCH_CPP_LOG_LEVEL", "PYTHONWARNINGS", "TORCH_LOGS")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(blocker), OUT=str(root / "out"),
               COLUMNS="200")
    for module in ("datasets", "torchao"):
        blocked = subprocess.run(["python3", "-c", f"import {module}"], env=env, capture_output=True, text=True)
        assert blocked.returncode != 0, f"the sitecustomize meant to hide `{module}` did not"
    prefix = no_network_prefix()
    done = subprocess.run([*prefix, "bash", "bench/gpu_session.sh", "--smoke"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=900)
    out = root / "out"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return SimpleNamespace(done=done, out=out, records=records, offline=bool(prefix), tree=tree)


def _by_workload(records: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for record in records:
        found.setdefault(record["workload"], []).append(record)
    return found


def test_the_gpu_command_runs_in_a_copy_without_git_offline_and_without_datasets(smoke):
    assert smoke.done.returncode == 0, smoke.done.stdout[-4000:] + smoke.done.stderr[-3000:]
    assert not (smoke.tree / ".git").exists()
    steps = {r["workload"][5:]: r for r in smoke.records if r["workload"].startswith("step:")}
    assert list(steps) == list(PLANS["all"]) and all(r["status"] == "ok" for r in steps.values()), steps
    assert {r["commit"] for r in smoke.records} == {COMMIT}
    assert f"commit {COMMIT} (bench/COMMIT)" in smoke.done.stdout
    by = _by_workload(smoke.records)
    assert by["preflight"][0]["datasets_importable"] is False
    assert by["tokenize:stdlib"][0]["datasets_importable"] is False
    # What gpu_session.sh exports (the NVML check keeps the parent from initializing CUDA before it forks).
    assert by["preflight"][0]["env"] == {
        "PYTORCH_ALLOC_CONF": "expandable_segments:True", "TORCH_CPP_LOG_LEVEL": "WARNING", "PYTHONWARNINGS": "default",
        "TORCH_LOGS": "graph_breaks,recompiles", "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    assert {f.name for f in smoke.out.iterdir()} <= OUT_FILES and all(f.is_file() for f in smoke.out.iterdir())
    assert len(OUT_FILES) <= MAX_OUT_FILES


def test_every_record_is_printed_on_stdout_and_summarized_at_the_end(smoke):
    stdout = smoke.done.stdout
    printed = [line for line in stdout.splitlines() if line.startswith("R ")]
    assert len(printed) == len(smoke.records)
    for line, record in zip(printed, smoke.records, strict=True):
        assert line.startswith(f"R {record['workload']} [{record['status']}]"), (line, record)
    comparison = next(r for r in smoke.records if r.get("side") == "comparison" and r["workload"] == "gpt2-small")
    assert f"ratio={comparison['ratio']:.4g}" in stdout  # a figure, not only a status, reaches stdout
    summary = stdout[stdout.index("= summary ="):]
    assert all(f"\n{step:18s} ok" in summary for step in PLANS["all"]), summary
    # With room in the 12,000 characters of stdout that come back. This is the smoke's plan "all", every step (and
    # every refusal, whose comparisons carry the reason); a window's plan runs under half of them, so its summary is
    # shorter still.
    assert len(summary) < 10_000
    # Each comparison is in the summary (each side's best round); the rounds themselves only in the R lines.
    comparisons = [r for r in smoke.records if r.get("side") == "comparison"]
    assert comparisons and all("  " + headline(r)[:220] in summary for r in comparisons)
    assert "side=nanopt " not in summary and "side=nanogpt-compiled " not in summary


def test_every_workload_is_recorded_with_every_key(smoke):
    assert set(_by_workload(smoke.records)) >= set(WORKLOADS)
    for record in smoke.records:
        assert set(REQUIRED_KEYS) <= set(record), record
        assert record["torch"] and record["date"] and record["gpu"] is None
        if not record["workload"].startswith("step:"):
            assert record["allow_tf32"] is False  # no GPU: no TF32 (MFU against the CPU's peak, as train's)


def test_each_step_compiles_no_more_graphs_than_its_budget_counts(smoke):
    steps = {r["workload"][5:]: r for r in smoke.records if r["workload"].startswith("step:")}
    planned = {s.name: s for s in STEPS}
    for name, record in steps.items():
        assert record["budgeted_graphs"] == len(planned[name].compiles)
        assert record["graph_check"] is None and (record["graphs"] is None or record["graphs"] <= len(
            planned[name].compiles)), record
    # Counted for real, not vacuously: the steps that compile on a GPU compile here too (a codeless backend).
    # fp8: `off` only (the CPU refuses FP8, and torchao is blocked); on an H100, `head` is the budget's second graph.
    compiled = {"preflight": 1, "throughput-gpt2": 2, "find-batch": 1, "bf16-vs-fp32": 1, "profile": 1,
                "throughput-llama": 2, "fp8": 1, "profile-llama": 1, "throughput-gpt2-64": 2, "muon": 2, "health": 1}
    assert {name: steps[name]["graphs"] for name in compiled} == compiled


def test_throughput_records_each_side_as_measured_then_compares_over_two_rounds(smoke):
    rows = _by_workload(smoke.records)["gpt2-small"]
    sides = [(r["side"], r.get("round"), r.get("accumulation")) for r in rows]
    # nanopt's first round is on record before the baseline is even built.
    assert sides[:2] == [("nanopt", 1, 1), ("nanopt", 1, 2)] and sides[2][0] == "nanogpt-compiled"
    assert {s for s in sides if s[0] != "comparison"} == {(side, rnd, acc) for side in ("nanopt", "nanogpt-compiled")
                                                           for rnd in (1, 2) for acc in (1, 2)}
    for r in (r for r in rows if r["side"] == "comparison"):
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
        assert r["baseline"] == "nanogpt-compiled" and len(r["ratio_rounds"]) == 2 and r["ratio_spread"] >= 0
    first = next(r for r in rows if r["side"] == "nanopt" and r["round"] == 1)
    assert first["warmup_s"] > 0 and first["compile_s"] is not None and first["alone"] is True
    llama = _by_workload(smoke.records)["llama-1b"]
    assert {r.get("round") for r in llama if r["side"] != "comparison"} == {1}  # one round: it does not fit twice


def test_memory_find_batch_bf16_profile_tests_and_resume_report_their_measurements(smoke):
    by = _by_workload(smoke.records)
    memory = by["memory:gpt2-small"] + by["memory:llama-1b"]
    assert len(memory) == 4 and {r["activation_checkpointing"] for r in memory} == {False, True}
    assert all(r["status"] == "ok" and r["peak_memory_gib"] > 0 and r["predicted_memory_gib"] > 0 for r in memory)
    eager, compiled = by["find-batch:gpt2-small"]
    assert eager["status"] == "ok" and eager["micro_batch"] >= 1 and eager["predicted_micro_batch"] >= 1
    assert eager["compile"] is False and "--max 8" in eager["command"] and eager["seconds"] > 0
    assert compiled["status"] == "ok" and compiled["compile"] is True and compiled["fits"] is True
    assert compiled["projected_default_search_s"] is not None  # from the throughput step's cold compile
    [fp8] = by["llama-1b:fp8"]  # torchao is blocked here, as on a machine without it: a skip, nothing started
    assert fp8["status"] == "skipped: torchao not installed" and fp8["fp8"] == "all" and "--fp8 all" in fp8["command"]
    [default] = by["find-batch-compiled:gpt2-small"]  # the default compiled search, whole
    assert default["status"] == "ok" and default["compile"] is True and default["micro_batch"] >= 1
    assert default["seconds"] > 0 and default["within_target"] is (default["seconds"] <= 120)
    assert default["trials"] == len(default["trial_seconds"]) >= 1 and default["isolation"] == "in-process"
    bf16, fp32, curves = by["bf16-vs-fp32:gpt2-small"]
    assert (bf16["side"], fp32["side"], curves["side"]) == ("bf16", "fp32", "comparison")
    assert bf16["graphs"] == 1 and fp32["graphs"] == 0 and bf16["recompiles"] == 0
    assert curves["status"] == "ok" and curves["compared_steps"] == curves["steps"] and curves["within_tolerance"]
    assert curves["reference"] == "fp32"  # a CPU has no TF32; on a GPU it says tf32 unless nanopt turned it off
    assert "eval_interval=0" in curves["command"]  # no evaluation graph the budget does not count
    [profile] = by["profile:gpt2-small"]
    assert profile["status"] == "ok" and {"matmul", "attention", "optimizer"} <= set(profile["categories"])
    assert "log_interval=10" in profile["command"]  # the preset's: no health probe in the profiled steps
    [tests] = by["gpu-tests"]
    assert tests["status"] == "ok" and tests["skipped"] >= 1 and "-m 'gpu'" in tests["command"]
    [resumed] = by["resume:gpt2-small"]
    assert resumed["status"] == "ok" and 0 < resumed["resumed_from"] < resumed["killed_after_step"] < resumed["steps"]
    assert resumed["max_abs_diff_after_resume"] == 0.0 and resumed["tolerance"] == 1e-3
    assert resumed["first_step_diff"] == 0.0 and resumed["nondeterminism_floor"] == 0.0  # the CPU is deterministic
    [preflight] = by["preflight"]
    assert preflight["compiled_ok"] is True and preflight["matmul_tflops"] > 0 and preflight["problems"] is None
    assert any("scaled_dot_product" in name for name in preflight["sdpa"]["gpt2-small"]), preflight["sdpa"]


def test_fp8_trains_what_the_cpu_allows_and_records_what_it_refuses(smoke):
    off, head, all_ = _by_workload(smoke.records)["fp8:gpt2-small"]
    assert [r["side"] for r in (off, head, all_)] == ["off", "head", "all"]
    assert off["status"] == "ok" and off["tokens_per_s"] > 0 and off["final_loss"] > 0 and off["graphs"] == 1
    assert "--set fp8=off" in off["command"] and "compile=true" in off["command"]
    # nanopt's own one-line refusal, recorded: the step goes on (on an A100 it would say so the same way).
    assert head["status"].startswith("skipped: nanopt refused it: runs/gpt2-small/train.json: key 'fp8'")
    assert "needs a CUDA GPU" in head["status"] and head["tokens_per_s"] is None
    assert all_["status"] == "skipped: torchao not installed"  # checked before training, as on the GPU machine


def test_muon_and_adamw_train_the_same_tokens_and_muon_carries_the_comparison(smoke):
    adamw, muon = _by_workload(smoke.records)["muon:gpt2-small"]
    assert (adamw["side"], muon["side"]) == ("adamw", "muon") and adamw["status"] == muon["status"] == "ok"
    assert adamw["tokens"] == muon["tokens"] > 0 and adamw["steps"] == muon["steps"]
    assert adamw["learning_rate"] == muon["learning_rate"] == 0.0006  # runs/gpt2-small's
    assert adamw["muon_learning_rate"] is None and muon["muon_learning_rate"] == 0.02  # nanopt's default
    assert muon["loss_diff"] == round(muon["late_mean_loss"] - adamw["late_mean_loss"], 5)
    assert muon["speed_ratio"] == round(muon["tokens_per_s"] / adamw["tokens_per_s"], 4)
    assert "--set optimizer=muon" in muon["command"]
    [alone] = _by_workload(smoke.records)["muon-step:gpt2-small"]  # the optimizer step alone, both ways
    assert alone["status"] == "ok" and alone["matrices"] == 6 and alone["torch_step_ms"] > 0
    assert alone["batched_step_ms"] > 0 and alone["speedup"] > 0 and len(alone["speedup_rounds"]) == alone["rounds"]


def test_health_profile_llama_and_micro_batch_64_report_their_measurements(smoke):
    by = _by_workload(smoke.records)
    [health] = by["health:gpt2-small"]
    assert health["status"] == "ok" and health["log_interval"] == 10 and health["blocks"] == 2
    assert health["step_s_off"] > 0 and health["step_s_on"] > 0 and isinstance(health["within_target"], bool)
    assert health["health_share"] == pytest.approx(health["monitor_share"] + health["probe_share"], abs=2e-6)
    [profile] = by["profile:llama-1b"]
    assert profile["status"] == "ok" and {"matmul", "attention", "optimizer"} <= set(profile["categories"])
    assert "log_interval=10" in profile["command"]  # the preset's: no health probe in the profiled steps
    assert profile["cpu_overhead_share"] is not None and profile["command"].startswith("nanopt profile runs/llama")
    assert json.loads((smoke.out / "profile_llama.json").read_text())["categories"]
    rows = by["gpt2-small:micro64"]
    assert {r["side"] for r in rows} == {"nanopt", "nanogpt-compiled", "comparison"}
    assert all(r["status"] == "ok" and "--run runs/gpt2-small " in r["command"] for r in rows)
    assert all(r["ratio"] > 0 for r in rows if r["side"] == "comparison")


def test_stacked_compares_both_sides_and_graphs_and_copies_record_their_refusals_on_the_cpu(smoke):
    by = _by_workload(smoke.records)
    stacked = by["gpt2-small:stacked"]
    assert {r["side"] for r in stacked} == {"separate", "stacked", "comparison"}
    assert all(r["status"] == "ok" for r in stacked)
    assert all(r["speedup"] > 0 and len(r["speedup_rounds"]) == 2 for r in stacked if r["side"] == "comparison")
    graphs = by["gpt2-small:graphs"]
    graphed = [r for r in graphs if r["side"] == "graphed"]
    assert graphed and all(r["status"].startswith("refused: ") and "needs a CUDA GPU" in r["status"] for r in graphed)
    launched = [r for r in graphs if r["side"] == "launched"]
    assert launched and all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in launched)
    comparisons = [r for r in graphs if r["side"] == "comparison"]
    assert comparisons and all("speedup" not in r and "graphed refused" in r["status"] for r in comparisons)
    for workload in ("gpt2-small:copies", "llama-1b:copies"):  # the smoke run computes in fp32
        rows = by[workload]
        copied = [r for r in rows if r["side"] == "copies"]
        assert copied and all("'bf16_weight_copies': true needs \"precision\": \"bf16\"" in r["status"]
                              for r in copied)
        assert [r for r in rows if r["side"] == "cast"] and all(r["status"] == "ok" for r in rows
                                                                  if r["side"] == "cast")


def test_residual_trains_the_fp32_stream_and_records_the_bf16_refusal_on_the_cpu(smoke):
    fp32, bf16 = _by_workload(smoke.records)["residual:gpt2-small"]
    assert (fp32["side"], bf16["side"]) == ("false", "true")
    assert fp32["status"] == "ok" and fp32["tokens_per_s"] > 0 and "--set bf16_residual=false" in fp32["command"]
    assert bf16["status"].startswith("skipped: nanopt refused it: runs/gpt2-small/train.json: key 'bf16_residual'")


def test_a_plan_is_trained_and_its_prediction_set_beside_what_it_measured(smoke):
    [planned] = _by_workload(smoke.records)["plan:gpt2"]
    assert planned["status"] == "ok" and planned["command"].startswith("nanopt plan --budget 1min --gpu cpu")
    assert "--data data/stdlib" in planned["command"] and "nanopt train runs/planned" in planned["command"]
    assert planned["params"] > 0 and planned["micro_batch"] >= 1
    # The smoke run plans for this CPU, which the plan measures; a GPU plan assumes its MFU.
    assert planned["mfu_source"] == "measured" and 0 < planned["mfu"] <= 1
    assert planned["step_ratio"] == pytest.approx(planned["measured_step_s"] / planned["predicted_step_s"])
    assert planned["peak_ratio"] > 0 and planned["measured_peak_gib"] > 0
