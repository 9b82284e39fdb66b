"""On a CPU `nanopt plan` measures a few real steps of the planned model and plans at the MFU they ran at
(nanopt.plan.recipe.probe); `nanopt estimate` and the prediction `nanopt train` records use that rate while the run
is as planned (nanopt.plan.planned_rate), and fall back to the assumed MFU, quietly, for a run changed since or a
plan.json that is damaged or crafted. Real plans of the tiny dataset on this CPU."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from nanopt.config import load_run
from nanopt.hardware import cpu_peak
from nanopt.model.flops import flops_per_token
from nanopt.plan.estimate import DEFAULT_MFU, EstimateOptions, estimate
from nanopt.plan.prediction import SETUP_S, Hardware, predict

pytestmark = pytest.mark.skipif(cpu_peak() is None, reason="no CPU peak known here: nothing to plan from")

# Two minutes: the measured rate decides the model, and on a loaded machine 30 s buys one under half the smallest.
BUDGET_S = 120
BUDGET = ("--budget", f"{BUDGET_S}s", "--gpu", "cpu", "--max-epochs", "1e6")
RESERVED = 0.02 + 0.01 + 0.01  # evaluation, checkpoints, other (docs/budget.md)


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path):
    """A two-minute CPU plan made by the CLI in this process: (the run, plan.json, what it printed, what it said on
    stderr). One plan serves every test: each measures for seconds."""
    from nanopt.cli import main

    run = tmp_path_factory.mktemp("measured") / "run"
    printed, said = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as leaving, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        main(["plan", "--data", str(tiny_dataset), "--out", str(run), *BUDGET])
    assert leaving.value.code == 0, said.getvalue()
    return run, json.loads((run / "plan.json").read_text()), printed.getvalue(), said.getvalue()


def source_of(run: Path) -> dict:
    return estimate(load_run(run), EstimateOptions(gpu="cpu"))["throughput_source"]


def test_the_plan_is_made_at_the_mfu_it_measured_here(planned):
    run, plan, _, _ = planned
    throughput, config = plan["throughput"], load_run(run)
    assert throughput["source"] == "measured" and 1 <= throughput["measurements"] <= 3
    assert 0 < throughput["mfu"] <= 1 and throughput["step_s"] > 0
    # At least 6 s of steps after the warmup (docs/budget.md): a shared machine's rate dips for a second or two.
    assert throughput["steps"] >= 2 and throughput["steps"] * throughput["step_s"] >= 6.0
    assert plan["device"]["mfu"] == throughput["mfu"] != DEFAULT_MFU
    # The budget's steps are bought at the measured rate: the compute is the budget's time at peak x that MFU...
    rate = cpu_peak().flops * throughput["mfu"]
    assert plan["compute"]["train_flops"] == pytest.approx((BUDGET_S - SETUP_S["cpu"]) / (1 + RESERVED) * rate)
    # ...and the plan's predicted speed is the same rate for the model it chose.
    assert plan["prediction"]["tokens_per_s"] == pytest.approx(rate / flops_per_token(config.model, config.seq_len))
    assert plan["prediction"]["throughput"]["mfu"] == throughput["mfu"]


def test_estimate_and_the_training_prediction_use_the_plans_rate_while_the_run_is_as_planned(planned):
    run, plan, _, _ = planned
    assert source_of(run) == {"kind": "plan-measured", "mfu": plan["throughput"]["mfu"],
                              "path": str(run / "plan.json"), "note": None}
    # What `nanopt train` records before its first step (nanopt.plan.prediction.record_prediction) on this CPU.
    at_train = predict(load_run(run), Hardware("cpu", 1, None), "nanopt train")
    assert at_train["throughput"]["source"] == "plan-measured"
    for key in ("tokens_per_s", "step_s", "total_s"):
        assert at_train[key] == pytest.approx(plan["prediction"][key]), key


def test_the_plans_rate_predicts_a_training_with_the_threads_it_measured_with_only(planned):
    # The plan measured with the suite's one thread; a training that gets two is another speed.
    run, plan, _, _ = planned
    assert plan["throughput"]["threads"] == 1
    config = load_run(run)
    kinds = {threads: predict(config, Hardware("cpu", 1, None, cpu_threads=threads), "nanopt train")["throughput"]
             for threads in (None, 1, 2)}
    assert kinds[None]["source"] == kinds[1]["source"] == "plan-measured"
    assert kinds[2]["source"] == "assumed" and kinds[2]["mfu"] == DEFAULT_MFU


def test_a_run_changed_since_the_plan_is_estimated_at_the_assumed_mfu(planned, tmp_path: Path):
    run, _, _, _ = planned
    changed = Path(tmp_path / "changed")
    changed.mkdir()
    for name in ("model.json", "plan.json"):
        (changed / name).write_bytes((run / name).read_bytes())
    train = json.loads((run / "train.json").read_text())
    train["data"] = str((run / train["data"]).resolve())
    train["micro_batch_size"] = max(1, train["micro_batch_size"] // 2)  # another step than the one measured
    (changed / "train.json").write_text(json.dumps(train))
    assert source_of(changed)["kind"] == "assumed" and source_of(changed)["mfu"] == DEFAULT_MFU
    train["micro_batch_size"] = json.loads((run / "train.json").read_text())["micro_batch_size"]
    (changed / "train.json").write_text(json.dumps(train))  # back as planned: the plan's rate again
    assert source_of(changed)["kind"] == "plan-measured"


@pytest.mark.parametrize("damage", ["mfu a string", "mfu above 1", "mfu zero", "no fingerprint", "not an object",
                                    "not json", "a directory", "too large"])
def test_a_damaged_or_crafted_plan_json_is_the_assumed_mfu_and_no_error(planned, tmp_path: Path, damage: str):
    run, plan, _, _ = planned
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("model.json", "train.json"):
        (copy / name).write_bytes((run / name).read_bytes())
    train = json.loads((copy / "train.json").read_text())
    train["data"] = str((run / train["data"]).resolve())
    (copy / "train.json").write_text(json.dumps(train))
    throughput = dict(plan["throughput"])
    record: object = {**plan, "throughput": throughput}
    if damage == "mfu a string":
        throughput["mfu"] = str(throughput["mfu"])
    elif damage == "mfu above 1":
        throughput["mfu"] = 1.5
    elif damage == "mfu zero":
        throughput["mfu"] = 0.0
    elif damage == "no fingerprint":
        del throughput["fingerprint"]
    elif damage == "not an object":
        record = [plan]
    target = copy / "plan.json"
    if damage == "not json":
        target.write_text("{\"throughput\": ")
    elif damage == "a directory":
        target.mkdir()
    elif damage == "too large":
        target.write_text(json.dumps({**plan, "padding": "x" * (2 << 20)}))
    else:
        target.write_text(json.dumps(record))
    source = source_of(copy)
    assert source["kind"] == "assumed" and source["mfu"] == DEFAULT_MFU, source
    assert not math.isnan(predict(load_run(copy), Hardware("cpu", 1, None), "nanopt train")["tokens_per_s"])


def test_an_mfu_given_is_assumed_and_nothing_is_measured(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    out = tmp_path / "given"
    result = cli_in_process("plan", "--data", tiny_dataset, "--out", out, *BUDGET, "--mfu", "0.3")
    assert result.returncode == 0, result.stderr
    assert "measuring" not in result.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["throughput"] == {"source": "assumed", "mfu": 0.3} and source_of(out)["kind"] == "assumed"


def test_the_cli_says_what_it_measures_and_at_what_mfu_it_planned(planned):
    _, plan, printed, said = planned
    assert said.count("measuring the planned step on this CPU") == plan["throughput"]["measurements"]
    words = " ".join(printed.replace("│", " ").split())
    assert f"{plan['throughput']['mfu']:.1%} measured on this CPU over {plan['throughput']['steps']} steps" in words


def test_a_large_plans_step_is_measured_in_part(planned):
    """A step of minutes (a CPU-days budget) is timed as steps of at most two micro-batches, each cut to about
    MICRO_BATCH_S at the assumed rate; a small plan's step is measured whole."""
    from nanopt.plan.recipe.probe import MICRO_BATCH_S, measured_run

    run = load_run(planned[0])
    sequence_flops = flops_per_token(run.model, run.seq_len) * run.seq_len
    assert measured_run(run, 1e3 * sequence_flops) is run  # a thousand sequences a second: whole
    for per_second in (4 / MICRO_BATCH_S, 1e-3):  # four sequences in the second, or one in a thousand seconds
        cut = measured_run(run, per_second * sequence_flops)
        assert cut.train.micro_batch_size == max(1, min(run.train.micro_batch_size, int(per_second * MICRO_BATCH_S)))
        assert cut.grad_accum_steps(1) <= 2 and cut.model == run.model and cut.seq_len == run.seq_len
