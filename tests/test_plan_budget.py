"""`nanopt plan`: a budget becomes a run directory whose learning rate and batch are DeepSeek LLM's fits at the run's
compute (recomputed here from the model nanopt builds, not from the plan's own arithmetic), whose micro-batch fits
by the memory model, and whose refusals (a dataset or a budget too small) come before anything is written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from clihelp import assert_user_error
from planhelp import deepseek_batch, deepseek_compute, deepseek_lr

from nanopt.config import load_run
from nanopt.hardware import GPUS


def plan(cli, tmp_path: Path, dataset: Path, *args: str, name: str = "run"):
    out = tmp_path / name
    return out, cli("plan", "--data", dataset, "--out", out, *args, *AT_STATED_MFU)


# The arithmetic at a stated MFU: a CPU plan would otherwise be made at the MFU it measures here
# (tests/test_plan_measures_cpu.py), which moves with the machine's load.
AT_STATED_MFU = ("--mfu", "0.4")


# Budgets from a CPU half-minute to a GPU cluster's day; the GPU plans read the tiny dataset many times over,
# which --max-epochs allows: the arithmetic, not the data, is under test here.
PLANS = {
    "cpu-30s": ("--budget", "30s", "--gpu", "cpu", "--max-epochs", "1e6", *AT_STATED_MFU),
    "h100x8-500USD": ("--budget", "500USD", "--gpu", "h100-sxm", "--num-gpus", "8", "--max-epochs", "1e6"),
    "h100x8-24h-gpt2": ("--budget", "24h", "--gpu", "h100", "--num-gpus", "8", "--family", "gpt2",
                        "--max-epochs", "1e6"),
    "a100x4-1e19": ("--budget", "1e19", "--gpu", "a100-80gb", "--num-gpus", "4", "--max-epochs", "1e6"),
    "4090-1e20": ("--budget", "1e20", "--gpu", "rtx-4090", "--max-epochs", "1e6"),
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> dict[str, Path]:
    from nanopt.cli import main

    root = tmp_path_factory.mktemp("plans")
    made = {}
    for name, args in PLANS.items():
        made[name] = root / name
        with pytest.raises(SystemExit) as leaving:
            main(["plan", "--data", str(tiny_dataset), "--out", str(made[name]), "--json", *args])
        assert leaving.value.code == 0, name
    return made


@pytest.mark.parametrize("name", PLANS)
def test_the_learning_rate_and_batch_are_deepseeks_fits_at_the_runs_compute(planned: dict[str, Path], name: str):
    run = load_run(planned[name])
    compute = deepseek_compute(planned[name])
    assert run.train.learning_rate == pytest.approx(deepseek_lr(compute), rel=1e-9)
    gpus = int(PLANS[name][PLANS[name].index("--num-gpus") + 1]) if "--num-gpus" in PLANS[name] else 1
    # The rule's batch in whole sequences per GPU, moved by at most 5% so that a micro-batch divides it.
    wanted = deepseek_batch(compute)
    rounding = run.seq_len * gpus / 2 / wanted
    assert abs(run.train.global_batch_tokens / wanted - 1) <= max(0.05, rounding) + 1e-9, (run.train, wanted)
    assert run.train.global_batch_tokens % (run.train.micro_batch_size * run.seq_len * gpus) == 0


@pytest.mark.parametrize("name", [n for n in PLANS if n != "cpu-30s"])
def test_the_micro_batch_fits_by_the_memory_model(planned: dict[str, Path], name: str):
    from nanopt.model.memory import estimate_memory

    run, args = load_run(planned[name]), PLANS[name]
    gpu = next(g for g in GPUS.values() if g.key == json.loads((planned[name] / "plan.json").read_text())[
        "device"]["gpu"])
    gpus = int(args[args.index("--num-gpus") + 1]) if "--num-gpus" in args else 1
    memory = estimate_memory(run.model, run.seq_len, precision="bf16", compiled=True,
                             activation_checkpointing=run.train.activation_checkpointing,
                             parallelism=run.train.parallelism, world_size=gpus, optimizer=run.train.optimizer,
                             cuda=True, step_sequences=run.sequences_per_rank(gpus), health=run.train.health)
    assert memory.total(run.train.micro_batch_size) <= gpu.memory_bytes


def test_a_plan_that_memory_binds_takes_a_smaller_micro_batch_and_accumulates(planned: dict[str, Path]):
    """1e20 FLOPs on one 24 GiB card: the rule's batch does not fit in one micro-batch."""
    run = load_run(planned["4090-1e20"])
    assert run.train.micro_batch_size < run.sequences_per_rank(1)
    assert run.grad_accum_steps(1) > 1


def test_a_money_budget_is_the_whole_runs_predicted_cost(planned: dict[str, Path]):
    record = json.loads((planned["h100x8-500USD"] / "plan.json").read_text())
    hours = 500 / (8 * GPUS["h100-sxm"].usd_per_hour)
    assert 0.95 * hours <= record["prediction"]["total_s"] / 3600 <= hours
    assert record["prediction"]["cost_usd"] == pytest.approx(500, rel=0.05) and record["prediction"]["cost_usd"] <= 500


def test_evaluation_and_checkpoints_stay_within_their_shares(planned: dict[str, Path]):
    for name, run_dir in planned.items():
        seconds = json.loads((run_dir / "plan.json").read_text())["prediction"]["seconds"]
        assert seconds["eval"] <= 0.02 * (seconds["eval"] + seconds["train"]), name
        assert seconds["checkpoint"] <= 0.01 * (seconds["checkpoint"] + seconds["train"]), name


def test_a_dataset_too_small_for_the_budget_is_said_before_anything_is_written(tmp_path: Path, tiny_dataset: Path,
                                                                              cli_in_process):
    out, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", "1min", "--gpu", "cpu")
    assert_user_error(result, f"--data {tiny_dataset}: its train split holds", "epochs, more than --max-epochs 4")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # Each way out the hint names plans: a lower budget (where one can be planned at all), more epochs allowed.
    lower = re.search(r"lower --budget to about (\S+),", result.stderr)
    epochs = re.search(r"--max-epochs (\d+)$", result.stderr.strip()).group(1)
    for args in ([("--budget", lower.group(1))] if lower else []) + [("--budget", "1min", "--max-epochs", epochs)]:
        out, result = plan(cli_in_process, tmp_path, tiny_dataset, *args, "--gpu", "cpu", name="-".join(args))
        assert result.returncode == 0, result.stderr
        record = json.loads((out / "plan.json").read_text())
        assert record["data"]["epochs"] <= record["data"]["max_epochs"]


def test_a_budget_too_small_for_the_smallest_model_names_one_that_is_not(tmp_path: Path, tiny_dataset: Path,
                                                                        cli_in_process):
    out, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", "1e9", "--gpu", "cpu")
    assert_user_error(result, "--budget 1e9: buys a compute-optimal model of", "raise --budget to at least")
    assert not out.exists()
    budget = re.search(r"raise --budget to at least (\S+)$", result.stderr.strip()).group(1)
    out, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", budget, "--gpu", "cpu",
                       "--max-epochs", "1e6")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("budget", "words"), [
    ("500", "a number without a unit"), ("5USD", "no price per hour for this machine's CPU"),
    ("1s", "is less than the"), ("ten dollars", "cannot read it"), ("-5h", "cannot read it"),
    ("1e40", "is outside what a run can be")])
def test_a_budget_that_cannot_be_planned_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                    budget: str, words: str):
    out, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", budget, "--gpu", "cpu")
    assert_user_error(result, words)
    assert not out.exists()


def test_a_run_directory_that_exists_is_not_written_over(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine\n")
    _, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", "30s", "--gpu", "cpu")
    assert_user_error(result, "already exists")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]


def test_the_plan_prints_cost_time_data_and_the_next_commands(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    out, result = plan(cli_in_process, tmp_path, tiny_dataset, "--budget", "30s", "--gpu", "cpu",
                       "--price-per-hour", "0.5", "--max-epochs", "20")
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "plan.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "plan.json", "train.json"]
    assert load_run(out).train.price_per_hour == 0.5
    for shown in ("predicted time", "predicted cost", f"{record['data']['epochs']:.2f} epochs",
                  f"nanopt train {out}", f"nanopt eval {out}"):
        assert shown in result.stdout, shown
    assert record["prediction"]["cost_usd"] == pytest.approx(record["prediction"]["total_s"] / 3600 * 0.5)
    assert record["prediction"]["total_s"] <= 30 and math.isclose(record["budget"]["amount"], 30)
