"""A planned run corrected by `nanopt preflight` (nanopt.plan.recipe.correct): the budget's steps recomputed here
from what preflight.json measured, the learning rate from DeepSeek LLM's published fit at the corrected compute,
the batch and model kept (they are what was measured); a run that started, a run nobody planned, --set and
--no-correct-plan leave train.json as it was. Real plans and real preflights on the CPU."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from clihelp import run_cli
from planhelp import deepseek_compute, deepseek_lr
from trainhelp import HIDE_CUDA, make_run

from nanopt.config import load_run
from nanopt.hardware import cpu_peak

pytestmark = pytest.mark.skipif(cpu_peak() is None, reason="no CPU peak known here: nothing to plan from")

BUDGET_S = 60.0  # steps of about 0.1 s: a batch's read stays a small share of one, as preflight checks
SHORT = ("--steps", "6", "--warmup", "1")  # a few measured steps: the arithmetic is under test, not the rate
# 0: every check passed; 3: one failed, which on a loaded 2-core machine can be the loader's share of a short step.
# The correction is made either way, from the rate measured.
MEASURED = (0, 3)
KEPT = ("micro_batch_size", "global_batch_tokens", "seq_len", "precision", "parallelism", "optimizer")


def _plan(root: Path, dataset: Path, name: str) -> Path:
    out = root / name
    made = run_cli("plan", "--budget", f"{BUDGET_S:g}s", "--gpu", "cpu", "--data", dataset, "--out", out,
                   "--max-epochs", "1e6", "--mfu", "0.4", env=HIDE_CUDA)  # the preflight measures: not the plan
    assert made.returncode == 0, made.stderr
    return out


@pytest.fixture(scope="module")
def corrected(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher):
    """A planned run before and after `nanopt preflight` (forked from the warm launcher: no import of torch per
    command): (run, train.json before, what preflight printed)."""
    out = tmp_path_factory.mktemp("corrected") / "run"
    made = launcher.run("plan", "--budget", f"{BUDGET_S:g}s", "--gpu", "cpu", "--data", tiny_dataset, "--out", out,
                        "--max-epochs", "1e6", "--mfu", "0.4")
    assert made.status == 0, made.stderr
    before = json.loads((out / "train.json").read_text())
    result = launcher.run("preflight", out, *SHORT)
    assert result.status in MEASURED, result.stderr
    return out, before, result.stdout


def test_the_steps_fill_the_budget_at_the_measured_rate(corrected):
    run, before, said = corrected
    measured = json.loads((run / "preflight.json").read_text())
    after = json.loads((run / "train.json").read_text())
    step_s = after["global_batch_tokens"] / measured["tokens_per_s"]
    reserved = 0.02 + 0.01 + 0.01  # evaluation, checkpoints, other (docs/budget.md)
    steps = math.floor((BUDGET_S - measured["setup_s"]) / (1 + reserved) / step_s)
    assert after["train_tokens"] == steps * after["global_batch_tokens"]
    assert "the plan, corrected from this measurement" in said and f"buys {steps:,} steps" in said
    plan = json.loads((run / "plan.json").read_text())
    assert plan["corrected"]["changes"]["train_tokens"] == {"planned": before["train_tokens"],
                                                            "corrected": after["train_tokens"]}
    assert plan["corrected"]["prediction"]["steps"] == steps


def test_the_learning_rate_is_the_rules_at_the_corrected_compute(corrected):
    run, before, _ = corrected
    after = json.loads((run / "train.json").read_text())
    assert after["learning_rate"] == pytest.approx(deepseek_lr(deepseek_compute(run)), rel=1e-9)
    if after["train_tokens"] != before["train_tokens"]:
        assert after["learning_rate"] != before["learning_rate"]


def test_what_the_preflight_measured_is_kept_and_the_run_trains_as_written(corrected):
    run, before, _ = corrected
    after = json.loads((run / "train.json").read_text())
    assert {key: after[key] for key in KEPT} == {key: before[key] for key in KEPT}
    config = load_run(run)  # valid as written
    assert 2 * config.train.warmup_steps <= config.total_steps and config.train.eval_interval <= config.total_steps
    stale = run_cli("estimate", run, "--json", env=HIDE_CUDA)
    assert json.loads(stale.stdout)["throughput_source"]["kind"] == "preflight"  # still the measured run


@pytest.mark.slow
def test_a_run_that_started_or_was_changed_with_set_is_not_rewritten(tmp_path: Path, tiny_dataset: Path):
    run = _plan(tmp_path, tiny_dataset, "started")
    (run / "metrics.jsonl").write_text("")
    planned = (run / "train.json").read_bytes()
    result = run_cli("preflight", run, *SHORT, env=HIDE_CUDA)
    assert result.returncode in MEASURED, result.stderr
    assert "the plan is not corrected" in result.stdout and "has started training" in result.stdout
    assert (run / "train.json").read_bytes() == planned and "corrected" not in json.loads(
        (run / "plan.json").read_text())
    (run / "metrics.jsonl").unlink()
    for flags in (("--no-correct-plan",), ("--set", "log_interval=2")):
        result = run_cli("preflight", run, *SHORT, *flags, env=HIDE_CUDA)
        assert result.returncode in MEASURED, result.stderr
        assert (run / "train.json").read_bytes() == planned, flags


def test_a_run_nobody_planned_is_left_alone(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, max_steps=8, eval_interval=4, micro_batch_size=8, global_batch_tokens=1024,
                   model={"hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 128})
    written = (run / "train.json").read_bytes()
    result = cli_in_process("preflight", run, *SHORT, "--json")
    assert result.returncode in MEASURED, result.stderr
    assert "plan_correction" not in json.loads(result.stdout)
    assert (run / "train.json").read_bytes() == written and not (run / "plan.json").exists()


@pytest.mark.slow
def test_a_corrected_plan_trains_to_its_end(corrected):
    run = corrected[0].parent / "copy"  # a sibling: train.json's data path is relative to the run
    shutil.copytree(corrected[0], run)
    result = run_cli("train", run, "--no-live", env=HIDE_CUDA)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps[-1] == load_run(run).total_steps
