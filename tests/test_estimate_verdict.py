"""`nanopt estimate` says whether a run fits and what would make it fit, estimates this machine's CPU, and reads
--mfu one way only (a fraction, 0.4 for 40%: 40 is refused with that hint)."""

from __future__ import annotations

import json
import math

import pytest
from clihelp import REPO, assert_user_error

from nanopt.config import load_run
from nanopt.hardware import GIB
from nanopt.model.flops import flops_per_token
from nanopt.plan.estimate import EstimateOptions, estimate

RUNS = REPO / "runs"


def estimate_json(cli, *args: object) -> dict:
    result = cli("estimate", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def remedy_fits(preset: str, remedy: dict, gpu_memory: int, overrides: dict | None = None) -> bool:
    """Whether the run with the remedy applied (its train.json values and GPU count) fits, by the same estimate."""
    run = load_run(RUNS / preset, {**(overrides or {}), **remedy["set"]})
    report = estimate(run, EstimateOptions(gpu_memory=gpu_memory, num_gpus=remedy["num_gpus"]))
    return report["fit"]["fits"]


def test_a_run_that_fits_says_so_with_its_largest_micro_batch(cli_in_process):
    report = estimate_json(cli_in_process, RUNS / "gpt2-small", "--gpu", "h100-sxm")
    assert report["fit"]["fits"] is True and report["fit"]["remedies"] == []
    assert f"up to about {report['max_micro_batch']}" in report["fit"]["verdict"]
    table = cli_in_process("estimate", RUNS / "gpt2-small", "--gpu", "h100-sxm")
    assert "fits:" in table.stdout


def test_a_run_that_only_run_healths_copy_keeps_from_fitting_is_told_to_turn_health_off(cli_in_process):
    """The 1B recomputing every block at micro-batch 1 on 22.5 GiB: the peak is a log step's update (weights,
    gradients, moments and health's copy of the weights: 24.0 GiB), which no smaller micro-batch lowers."""
    memory, overrides = 23034 << 20, {"activation_checkpointing": True, "micro_batch_size": 1}
    report = estimate_json(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "23034MiB",
                           *(arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}".lower())))
    fit = report["fit"]
    assert fit["fits"] is False and report["memory_bytes"]["health_snapshot"] > 4 * GIB
    [health] = [r for r in fit["remedies"] if r["set"] == {"health": False}]
    assert "run health copies the weights around each log step's update (4.60 GiB)" in health["text"]
    assert remedy_fits("llama-3.2-1b", health, memory, overrides)


@pytest.mark.parametrize("preset, memory", [("llama-3.2-1b", 16 * GIB), ("gpt2-small", 3 * GIB),
                                            ("smollm-360m", 8 * GIB)])
def test_a_run_that_does_not_fit_at_micro_batch_1_gets_remedies_that_work(preset: str, memory: int,
                                                                          cli_in_process):
    report = estimate_json(cli_in_process, RUNS / preset, "--gpu-memory", f"{memory // GIB}GiB")
    fit = report["fit"]
    assert fit["fits"] is False and report["max_micro_batch"] == 0
    assert "does not fit" in fit["verdict"] and f"{memory // GIB}.00 GiB" in fit["verdict"]
    assert fit["remedies"], fit
    for remedy in fit["remedies"]:
        assert remedy_fits(preset, remedy, memory), remedy
    [rung] = [r for r in fit["remedies"] if "memory ladder recommends" in r["text"]]
    ladder = estimate(load_run(RUNS / preset), EstimateOptions(gpu_memory=memory, num_gpus=rung["num_gpus"]))["ladder"]
    assert ladder["recommended"]["name"] in rung["text"] and f"{rung['num_gpus']} GPU" in rung["text"]
    assert {key: ladder["recommended"][key] for key in rung["set"] if key != "micro_batch_size"}.items() <= \
        rung["set"].items()
    if rung["num_gpus"] > 1:  # more GPUs than the run's: the fewest on which FSDP2 fits, recomputing every block
        fewer = {"set": {"parallelism": "fsdp", "activation_checkpointing": True, "micro_batch_size": 1},
                 "num_gpus": rung["num_gpus"] - 1}
        assert fewer["num_gpus"] < 2 or not remedy_fits(preset, fewer, memory)

    table = cli_in_process("estimate", RUNS / preset, "--gpu-memory", f"{memory // GIB}GiB")
    assert "does not fit" in table.stdout and "the memory ladder recommends" in table.stdout


def test_the_remedy_on_the_runs_gpus_is_the_ladders_recommendation():
    run = load_run(RUNS / "gpt2-small")
    report = estimate(run, EstimateOptions(gpu_memory=int(3.25 * GIB)))
    [rung] = [r for r in report["fit"]["remedies"] if "memory ladder recommends" in r["text"]]
    assert rung["num_gpus"] == 1
    assert report["ladder"]["recommended"]["name"] in rung["text"]
    assert remedy_fits("gpt2-small", rung, int(3.25 * GIB))
    assert not remedy_fits("gpt2-small", {"set": {}, "num_gpus": 1}, int(3.25 * GIB))


def test_a_micro_batch_too_large_is_told_the_largest_that_fits():
    run = load_run(RUNS / "gpt2-small")
    report = estimate(run, EstimateOptions(gpu_memory=4 * GIB))
    largest = report["max_micro_batch"]
    assert 1 <= largest < run.train.micro_batch_size
    fit = report["fit"]
    assert fit["fits"] is False and f"micro_batch_size {run.train.micro_batch_size}" in fit["verdict"]
    smaller = [r for r in fit["remedies"] if set(r["set"]) == {"micro_batch_size"}]
    assert len(smaller) == 1 and 1 <= smaller[0]["set"]["micro_batch_size"] <= largest
    assert run.train.global_batch_tokens % (smaller[0]["set"]["micro_batch_size"] * run.seq_len) == 0
    for remedy in fit["remedies"]:
        assert remedy_fits("gpt2-small", remedy, 4 * GIB), remedy
        assert remedy["num_gpus"] >= 2 or remedy["set"].get("parallelism") != "fsdp", remedy  # FSDP on 1: DDP


def test_a_bare_parameter_count_is_judged_on_its_states(cli_in_process):
    report = estimate_json(cli_in_process, "--params", "7e9", "--gpu", "a100-80gb")
    fit = report["fit"]
    assert fit["fits"] is False and "weights, gradients and optimizer state" in fit["verdict"]
    [fsdp] = fit["remedies"]
    gpus = fsdp["num_gpus"]
    states = 16 * 7e9
    assert states / gpus + GIB <= 80 * GIB < states / (gpus - 1) + GIB


# -------------------------------------------------------------------------------------------------- the CPU


def test_the_cpu_target_is_this_machine(cli_in_process):
    # --mfu given: the assumption is tested even where runs/demo holds a preflight.json of a user's own
    report = estimate_json(cli_in_process, RUNS / "demo", "--gpu", "cpu", "--peak-tflops", "0.1", "--mfu", "0.4")
    gpu = report["gpu"]
    assert gpu["key"] == "cpu" and gpu["peak_tflops"] == 0.1 and gpu["usd_per_hour"] is None
    assert report["cost_usd"] is None  # your own machine: no price unless one is given
    assert report["memory_assumptions"]["precision"] == "fp32" and report["memory_assumptions"]["compile"] is False
    import psutil

    assert 0 < report["gpu_memory_bytes"] <= psutil.virtual_memory().total
    run = load_run(RUNS / "demo")
    expected = run.total_tokens * flops_per_token(run.model, run.seq_len) / (0.1e12 * 0.4)
    assert math.isclose(report["train_seconds"], expected)
    assert report["fit"]["fits"] is True

    priced = estimate_json(cli_in_process, RUNS / "demo", "--gpu", "cpu", "--peak-tflops", "0.1", "--mfu", "0.4",
                           "--price-per-hour", "0.5", "--gpu-memory", "1GiB")
    assert math.isclose(priced["cost_usd"], priced["train_hours"] * 0.5)
    assert priced["gpu_memory_bytes"] == GIB

    table = cli_in_process("estimate", RUNS / "demo", "--gpu", "cpu", "--peak-tflops", "0.1")
    assert table.returncode == 0 and "RAM" in table.stdout


def test_the_cpu_peak_comes_from_the_processor_or_is_asked_for(cli_in_process):
    result = cli_in_process("estimate", RUNS / "demo", "--gpu", "cpu", "--json")
    if result.returncode == 0:  # Linux on x86 or Arm: cores x clock x FLOPs per cycle, said so
        gpu = json.loads(result.stdout)["gpu"]
        assert gpu["peak_tflops"] > 0 and "FLOP/cycle" in gpu["peak_source"] and "cores" in gpu["peak_source"]
    else:
        assert_user_error(result, "--gpu cpu", "--peak-tflops")


def test_the_cpu_is_one_machine(cli_in_process):
    assert_user_error(cli_in_process("estimate", RUNS / "demo", "--gpu", "cpu", "--num-gpus", "4"),
                      "--num-gpus", "--gpu cpu")


# ------------------------------------------------------------------------------------------------- --mfu


def test_mfu_is_a_fraction_and_a_percentage_is_explained(cli_in_process):
    assert_user_error(cli_in_process("estimate", RUNS / "gpt2-small", "--mfu", "40"), "--mfu", "0.4 means 40%")
    assert_user_error(cli_in_process("estimate", RUNS / "gpt2-small", "--mfu", "0"), "--mfu")
    help_text = cli_in_process("estimate", "--help").stdout
    assert "0.4 means 40%" in " ".join(help_text.replace("│", " ").split())
