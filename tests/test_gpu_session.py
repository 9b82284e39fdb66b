"""bench/gpu_session.py, the one-command GPU session, in its CPU smoke mode: run as a real process the way the GPU
machine runs it (nanopt from the tree through PYTHONPATH, `datasets` not importable), so the script cannot rot
between the rare GPU runs. One run serves every check: it kills one step at the end of a tiny budget on purpose."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clihelp import REPO

SCRIPT = REPO / "bench" / "gpu_session.py"
REQUIRED_KEYS = ("date", "gpu", "torch", "commit", "command", "workload", "tokens_per_s", "mfu",
                 "baseline_tokens_per_s", "peak_memory_gib", "predicted_memory_gib", "baseline")
WORKLOADS = ("env", "gpt2-small", "llama-1b", "memory:gpt2-small", "memory:llama-1b", "tokenize:stdlib",
             "find-batch:gpt2-small", "bf16-vs-fp32:gpt2-small", "profile:gpt2-small", "gpu-tests",
             "resume:gpt2-small")
KILLED = "throughput-llama"  # given a budget far below what it needs; the memory step after it must still run


def _session_module():
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT of one smoke session, with `import datasets` failing as on the GPU machine."""
    root = tmp_path_factory.mktemp("gpu-session")
    blocker = root / "no_datasets"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['datasets'] = None\n")
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}", "COLUMNS": "200"}
    blocked = subprocess.run([sys.executable, "-c", "import datasets"], env=env, capture_output=True, text=True)
    assert blocked.returncode != 0, "the sitecustomize meant to hide `datasets` did not"
    out = root / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--smoke", "--commit", "c0ffee1",
                           "--budget", f"{KILLED}=0.2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_workload_is_recorded_with_every_key(smoke: Path):
    records = _records(smoke)
    assert {r["workload"] for r in records} >= set(WORKLOADS)
    for record in records:
        assert set(REQUIRED_KEYS) <= set(record), record
        assert record["commit"] == "c0ffee1" and record["torch"] and record["date"]
        assert record["mfu"] is None and record["gpu"] is None  # no GPU: no peak to measure against
    assert {f.name for f in smoke.iterdir()} <= {"results.jsonl", "session.log", "env.txt", "find_batch.json",
                                                 "profile.json", "gpu_tests.txt"}


def test_a_step_over_its_budget_is_killed_and_recorded_and_the_next_runs(smoke: Path):
    records = _records(smoke)
    killed = [r for r in records if r["workload"] == "llama-1b"]
    assert killed and all(r["status"].startswith("timed out") for r in killed), killed
    memory = [r for r in records if r["workload"].startswith("memory:")]
    assert memory and all(r["status"] == "ok" and r["peak_memory_gib"] > 0 and r["predicted_memory_gib"] > 0
                          for r in memory), memory
    assert {(r["activation_checkpointing"]) for r in memory} == {False, True}
    log = (smoke / "session.log").read_text()
    assert f"=== {KILLED}: timed out" in log


def test_throughput_compares_nanopt_with_both_baselines_at_two_accumulations(smoke: Path):
    rows = [r for r in _records(smoke) if r["workload"] == "gpt2-small"]
    assert {(r["baseline"], r["accumulation"]) for r in rows} == {
        ("nanogpt-eager", 1), ("nanogpt-eager", 2), ("nanogpt-compiled", 1), ("nanogpt-compiled", 2)}
    for r in rows:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
        assert r["peak_memory_gib"] > 0 and r["predicted_memory_gib"] > 0


def test_data_find_batch_bf16_profile_and_tests_steps_report_their_measurements(smoke: Path):
    by_workload = {r["workload"]: r for r in _records(smoke)}
    tokenized = by_workload["tokenize:stdlib"]
    assert tokenized["status"] == "ok" and tokenized["datasets_importable"] is False
    found = by_workload["find-batch:gpt2-small"]
    assert found["status"] == "ok" and found["micro_batch"] >= 1 and found["predicted_micro_batch"] >= 1
    assert found["seconds"] > 0 and (smoke / "find_batch.json").exists()
    curves = by_workload["bf16-vs-fp32:gpt2-small"]
    assert curves["status"] == "ok" and curves["compared_steps"] == curves["steps"]
    assert curves["within_tolerance"] is True and curves["recompiles"] == {"bf16": 0, "fp32": 0}
    profile = by_workload["profile:gpt2-small"]
    assert profile["status"] == "ok" and {"matmul", "attention", "optimizer"} <= set(profile["categories"])
    assert profile["data_wait_share"] is not None
    tests = by_workload["gpu-tests"]
    assert tests["status"] == "ok" and tests["skipped"] >= 1  # no CUDA here: the GPU tests skip, and are counted
    resumed = by_workload["resume:gpt2-small"]
    assert resumed["status"] == "ok" and 0 < resumed["resumed_from"] < resumed["killed_after_step"] < resumed["steps"]
    assert resumed["max_abs_diff_after_resume"] == 0.0  # fp32 on a CPU: the resumed curve is the same curve


def test_loss_curves_outside_the_tolerance_are_flagged():
    session = _session_module()
    fp32 = {step: 7.0 - 0.01 * step for step in range(1, 51)}
    assert session.compare_curves(dict(fp32), fp32)["within_tolerance"] is True
    drifted = {step: loss * 1.05 if step > 40 else loss for step, loss in fp32.items()}
    assert session.compare_curves(drifted, fp32)["within_tolerance"] is False
    early_jump = {step: loss + (0.2 if step == 3 else 0.0) for step, loss in fp32.items()}
    assert session.compare_curves(early_jump, fp32)["within_tolerance"] is False


def test_a_bad_budget_is_refused_before_anything_runs(tmp_path: Path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--smoke",
                           "--budget", "warp-drive=10"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "warp-drive" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
