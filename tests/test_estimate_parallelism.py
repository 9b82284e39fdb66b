"""`nanopt estimate` recommends the parallelism: for each GPU count, the memory ladder's recommendation there (the
fastest rung that fits: nanopt.plan.estimate.ladder), judged by the same memory model and the same rule as the
estimate's own memory verdict (one home for the advice: two tables that disagree leave the reader with none).

The oracles are the ladder of `nanopt estimate --num-gpus N` (each row is its recommendation, or its leanest rung
when none fits) and the verdict: the run with a row's rung set in train.json (`--set`) and its GPU count
(`--num-gpus`) fits exactly when the row says so."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from clihelp import REPO

from nanopt.config import load_run
from nanopt.hardware import GIB, GPUS
from nanopt.plan.estimate import EstimateOptions, estimate

RUNS = REPO / "runs"
COUNTS = [1, 2, 4, 8, 16, 32, 64]
SETTINGS = ("parallelism", "activation_checkpointing", "optimizer")


def parallelism(cli, *args: object) -> dict:
    result = cli("estimate", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["parallelism"]


def row(table: dict, gpus: int) -> dict:
    [found] = [r for r in table["rows"] if r["gpus"] == gpus]
    return found


def verdict(preset: str, layout: dict, gpus: int, micro_batch: int, **opts) -> dict:
    """The estimate's single memory verdict for the run with this layout, GPU count and micro-batch."""
    run = load_run(RUNS / preset, {**{key: layout[key] for key in SETTINGS}, "micro_batch_size": micro_batch})
    return estimate(run, EstimateOptions(num_gpus=gpus, **opts))


def falling(values: list[int]) -> bool:
    return all(later < earlier for earlier, later in pairwise(values))


def layout_of(r: dict) -> tuple:
    return tuple(r["layout"][key] for key in SETTINGS)


def test_llama_1b_on_an_80gb_gpu_fits_ddp_on_one_gpu_as_the_verdict_says(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm")
    assert [r["gpus"] for r in table["rows"]] == COUNTS
    one = row(table, 1)
    single = verdict("llama-3.2-1b", one["layout"], 1, 4, gpu="h100-sxm")
    assert one["fits"] is single["fit"]["fits"] is True
    assert layout_of(one) == ("ddp", False, "adamw") and one["layout"]["name"] == "DDP"
    assert one["memory_bytes"] == single["memory_bytes"]["total"] <= table["gpu_memory_bytes"]
    assert table["gpu_memory_bytes"] == GPUS["h100-sxm"].memory_bytes
    assert one["headroom_bytes"] == table["gpu_memory_bytes"] - one["memory_bytes"]
    assert one["max_micro_batch"] == single["max_micro_batch"]


def test_a_model_too_large_for_one_gpu_needs_a_sharded_rung_on_eight(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "12GiB", "--gpu", "h100-sxm")
    one = row(table, 1)
    # nothing fits on one GPU, by the amount the leanest rung is over; FSDP2 on one process is DDP: not offered
    assert one["fits"] is False and one["layout"]["parallelism"] == "ddp"
    leanest = verdict("llama-3.2-1b", one["layout"], 1, one["micro_batch_size"], gpu_memory=12 * GIB)
    assert leanest["fit"]["fits"] is False and one["memory_bytes"] == leanest["memory_bytes"]["total"]
    assert one["headroom_bytes"] == 12 * GIB - one["memory_bytes"] < 0
    assert "does not fit" in one["text"] and f"{-one['headroom_bytes'] / GIB:.2f} GiB" in one["text"]
    eight = row(table, 8)
    assert eight["fits"] is True and eight["layout"]["parallelism"] in ("zero2", "fsdp", "fsdp_offload")


def test_fsdp2_memory_per_gpu_falls_as_gpus_are_added(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm", "--set", "parallelism=fsdp")
    own = [row(table, gpus)["run_layout"]["memory_bytes"] for gpus in COUNTS]
    assert falling(own[1:]), own  # from 2 GPUs on: sharded


@pytest.mark.parametrize("preset, memory", [("gpt2-small", "3GiB"), ("gpt2-small", "80GiB"), ("smollm-360m", "9GiB"),
                                            ("llama-3.2-1b", "12GiB"), ("llama-1b-131k", "24GiB")])
def test_every_row_is_the_ladders_recommendation_and_the_verdict_agrees(preset: str, memory: str, cli_in_process):
    table = parallelism(cli_in_process, RUNS / preset, "--gpu-memory", memory, "--gpu", "h100-sxm")
    gpu_memory = int(memory[:-3]) * GIB
    single = estimate(load_run(RUNS / preset), EstimateOptions(gpu_memory=gpu_memory, num_gpus=1))
    own = row(table, 1)["run_layout"]
    assert (own["fits"], own["memory_bytes"]) == (single["fit"]["fits"], single["memory_bytes"]["total"])
    for r in table["rows"]:
        ladder = estimate(load_run(RUNS / preset), EstimateOptions(gpu_memory=gpu_memory, num_gpus=r["gpus"]))["ladder"]
        expected = ladder["recommended"] or min(ladder["rows"], key=lambda rung: rung["memory_bytes"])
        assert (r["layout"]["name"], r["memory_bytes"], r["fits"]) == \
            (expected["name"], expected["memory_bytes"], expected["fits"]), r
        judged = verdict(preset, r["layout"], r["gpus"], r["micro_batch_size"], gpu_memory=gpu_memory)
        assert judged["fit"]["fits"] is r["fits"], r


def test_the_runs_own_layout_agrees_with_the_verdict_and_the_advice_is_the_ladders(cli_in_process):
    """The parallelism table, its warning, the verdict's remedy and the ladder name one rung (the older
    warning once said FSDP2 + checkpointing where the ladder recommended CPU offload)."""
    args = (RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm", "--num-gpus", "8")
    result = cli_in_process("estimate", *args, "--json")
    report = json.loads(result.stdout)
    table, recommended = report["parallelism"], report["ladder"]["recommended"]
    assert table["run_gpus"] == 8 and table["run_layout"]["name"] == "DDP"
    eight = row(table, 8)
    assert eight["run_layout"]["fits"] is report["fit"]["fits"] is False
    assert eight["run_layout"]["memory_bytes"] == report["memory_bytes"]["total"]
    assert eight["layout"]["name"] == recommended["name"]
    warning = table["warning"]
    assert "DDP" in warning and "does not fit" in warning and recommended["name"] in warning
    assert "on 8 GPUs of 16.00 GiB" in warning and f"parallelism={recommended['parallelism']}" in warning
    [remedy] = [r for r in report["fit"]["remedies"] if "memory ladder recommends" in r["text"]]
    assert remedy["num_gpus"] == 8 and remedy["set"]["parallelism"] == recommended["parallelism"]
    assert recommended["name"] in remedy["text"]

    text = cli_in_process("estimate", *args)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert not [line for line in lines if line.startswith("warning:")]  # said once, by the verdict and the ladder
    assert any(line.split()[:2] == ["8", "*"] and recommended["name"] in line for line in lines), text.stdout
    assert any(line.startswith("recommended: " + recommended["name"]) for line in lines), text.stdout

    fits = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm", "--num-gpus", "8")
    assert fits["warning"] is None and row(fits, 8)["run_layout"]["fits"] is True


def test_an_uncommon_gpu_count_gets_its_own_row_and_cpu_estimates_have_no_table(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "gpt2-small", "--gpu", "h100-sxm", "--num-gpus", "3")
    assert [r["gpus"] for r in table["rows"]] == [1, 2, 3, 4, 8, 16, 32, 64]
    assert row(table, 3)["note"] is not None  # 512 sequences do not split over 3 GPUs
    assert row(table, 64)["run_layout"]["micro_batch_size"] == 8  # 512 sequences over 64 GPUs: 8 each, not 16
    assert row(table, 64)["micro_batch_size"] <= 8
    assert parallelism(cli_in_process, RUNS / "demo", "--gpu", "cpu", "--peak-tflops", "0.1", "--mfu", "0.4") is None


def test_a_muon_run_is_offered_fsdp2_layouts_too(cli_in_process):
    """Muon runs under FSDP2 (its momentum sharded like AdamW's moments): a model too large for DDP gets FSDP2."""
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm",
                        "--set", "optimizer=muon")
    assert row(table, 8)["fits"] and row(table, 8)["layout"]["parallelism"] in ("zero2", "fsdp")
    assert row(table, 8)["layout"]["optimizer"] == "muon"


def test_a_gpu_count_the_global_batch_does_not_split_over_is_not_marked_as_fitting(cli_in_process):
    """The demo's global batch is 8 sequences: on 16 GPUs and more it does not split, and the note under the table
    says so; the train.json column must say the same, not "fits"."""
    table = parallelism(cli_in_process, RUNS / "demo", "--gpu", "h100-sxm")
    for gpus in (16, 32, 64):
        own = row(table, gpus)["run_layout"]
        assert "does not split" in row(table, gpus)["note"]
        assert (own["fits"], own["batch_splits"]) == (False, False)
    assert row(table, 8)["run_layout"]["fits"] and row(table, 8)["run_layout"]["batch_splits"]
    text = cli_in_process("estimate", RUNS / "demo", "--gpu", "h100-sxm")
    lines = {line.split()[0]: line.split() for line in text.stdout.splitlines() if line.split()[:1] in
             (["8"], ["16"], ["32"], ["64"]) and "DDP" in line}
    assert lines["8"][-1] == "fits" and all(lines[gpus][-1] == "batch" for gpus in ("16", "32", "64")), text.stdout
    assert "batch: the global batch does not split over this many GPUs (the note below)" in " ".join(
        text.stdout.split())
