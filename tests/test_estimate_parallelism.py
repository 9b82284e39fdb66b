"""`nanopt estimate` recommends the parallelism: for each GPU count, the cheapest layout (DDP, DDP + activation
checkpointing, FSDP2, FSDP2 + activation checkpointing) that fits, judged by the same memory model and the same
rule as the estimate's own memory verdict (issue #16, item 6).

The oracle is that verdict: the run with a row's layout set in train.json (`--set`) and its GPU count
(`--num-gpus`) must fit, and every layout preferred before it must not."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from clihelp import REPO

from nanopt.config import load_run
from nanopt.hardware import GIB
from nanopt.plan.estimate import EstimateOptions, estimate

RUNS = REPO / "runs"
LAYOUTS = [("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)]  # the order of preference
COUNTS = [1, 2, 4, 8, 16, 32, 64]


def parallelism(cli, *args: object) -> dict:
    result = cli("estimate", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["parallelism"]


def row(table: dict, gpus: int) -> dict:
    [found] = [r for r in table["rows"] if r["gpus"] == gpus]
    return found


def verdict(preset: str, layout: tuple[str, bool], gpus: int, micro_batch: int, **opts) -> dict:
    """The estimate's single memory verdict for the run with this layout, GPU count and micro-batch."""
    run = load_run(RUNS / preset, {"parallelism": layout[0], "activation_checkpointing": layout[1],
                                   "micro_batch_size": micro_batch})
    return estimate(run, EstimateOptions(num_gpus=gpus, **opts))


def falling(values: list[int]) -> bool:
    return all(later < earlier for earlier, later in pairwise(values))


def layout_of(r: dict) -> tuple[str, bool]:
    return r["layout"]["parallelism"], r["layout"]["activation_checkpointing"]


def test_llama_1b_on_an_80gb_gpu_fits_ddp_on_one_gpu_as_the_verdict_says(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm")
    assert [r["gpus"] for r in table["rows"]] == COUNTS
    one = row(table, 1)
    single = verdict("llama-3.2-1b", ("ddp", False), 1, 4, gpu="h100-sxm")
    assert one["fits"] is single["fit"]["fits"] is True
    assert layout_of(one) == ("ddp", False) and one["layout"]["name"] == "DDP"
    assert one["memory_bytes"] == single["memory_bytes"]["total"] <= table["gpu_memory_bytes"] == 80 * GIB
    assert one["headroom_bytes"] == table["gpu_memory_bytes"] - one["memory_bytes"]
    assert one["max_micro_batch"] == single["max_micro_batch"]


def test_a_model_too_large_for_one_gpu_needs_fsdp2_on_eight(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm")
    one = row(table, 1)
    assert one["fits"] is False and one["layout"] is not None
    # nothing fits on one GPU, by the amount the leanest layout is over
    assert layout_of(one) == ("ddp", True)  # FSDP2 on one process is DDP: not offered
    leanest = verdict("llama-3.2-1b", ("ddp", True), 1, 4, gpu_memory=16 * GIB)
    assert leanest["fit"]["fits"] is False and one["memory_bytes"] == leanest["memory_bytes"]["total"]
    assert one["headroom_bytes"] == 16 * GIB - one["memory_bytes"] < 0
    assert "does not fit" in one["text"] and f"{-one['headroom_bytes'] / GIB:.2f} GiB" in one["text"]
    eight = row(table, 8)
    assert eight["fits"] is True and eight["layout"]["parallelism"] == "fsdp"
    for layout in LAYOUTS[:2]:  # neither DDP layout fits on 8 GPUs: FSDP2 is needed
        assert verdict("llama-3.2-1b", layout, 8, 4, gpu_memory=16 * GIB)["fit"]["fits"] is False


def test_the_smallest_gpu_of_the_table_needs_activation_checkpointing(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "rtx-4090", "--set", "micro_batch_size=2")
    one = row(table, 1)
    assert one["fits"] is True and layout_of(one) == ("ddp", True)
    assert one["layout"]["name"] == "DDP + activation checkpointing"
    assert verdict("llama-3.2-1b", ("ddp", False), 1, 2, gpu="rtx-4090")["fit"]["fits"] is False
    assert verdict("llama-3.2-1b", ("ddp", True), 1, 2, gpu="rtx-4090")["fit"]["fits"] is True


def test_fsdp2_memory_per_gpu_falls_as_gpus_are_added(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm", "--set", "parallelism=fsdp")
    own = [row(table, gpus)["run_layout"]["memory_bytes"] for gpus in COUNTS]
    assert falling(own[1:]), own  # from 2 GPUs on: sharded
    small = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm")
    fsdp = [r["memory_bytes"] for r in small["rows"] if layout_of(r) == ("fsdp", False)]
    assert len(fsdp) >= 3 and falling(fsdp), fsdp


@pytest.mark.parametrize("preset, memory", [("gpt2-small", "3GiB"), ("gpt2-small", "80GiB"), ("smollm-360m", "9GiB"),
                                            ("llama-3.2-1b", "12GiB"), ("llama-1b-131k", "24GiB")])
def test_every_recommendation_is_the_first_layout_the_verdict_fits(preset: str, memory: str, cli_in_process):
    table = parallelism(cli_in_process, RUNS / preset, "--gpu-memory", memory, "--gpu", "h100-sxm")
    gpu_memory = int(memory[:-3]) * GIB
    single = estimate(load_run(RUNS / preset), EstimateOptions(gpu_memory=gpu_memory, num_gpus=1))
    assert row(table, 1)["run_layout"] == {"fits": single["fit"]["fits"],
                                           "memory_bytes": single["memory_bytes"]["total"]}
    for r in table["rows"]:
        candidates = LAYOUTS if r["gpus"] > 1 else LAYOUTS[:2]
        fits = [verdict(preset, layout, r["gpus"], r["micro_batch_size"], gpu_memory=gpu_memory)["fit"]["fits"]
                for layout in candidates]
        assert r["fits"] is any(fits), r
        expected = candidates[fits.index(True)] if any(fits) else candidates[-1]
        assert layout_of(r) == expected, r


def test_the_runs_own_layout_agrees_with_the_verdict_and_a_misfit_is_warned(cli_in_process):
    args = (RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm", "--num-gpus", "8")
    result = cli_in_process("estimate", *args, "--json")
    report = json.loads(result.stdout)
    table = report["parallelism"]
    assert table["run_gpus"] == 8 and table["run_layout"]["name"] == "DDP"
    eight = row(table, 8)
    assert eight["run_layout"]["fits"] is report["fit"]["fits"] is False
    assert eight["run_layout"]["memory_bytes"] == report["memory_bytes"]["total"]
    warning = table["warning"]
    assert "DDP" in warning and "does not fit" in warning and "parallelism=fsdp" in warning
    assert "on 8 GPUs of 16.00 GiB" in warning and f"micro-batch {eight['micro_batch_size']}" in warning

    text = cli_in_process("estimate", *args)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 1 and "parallelism=fsdp" in warned[0]
    assert any(line.split()[:3] == ["8", "*", "FSDP2"] for line in lines), text.stdout

    fits = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "h100-sxm", "--num-gpus", "8")
    assert fits["warning"] is None and row(fits, 8)["run_layout"]["fits"] is True


def test_an_uncommon_gpu_count_gets_its_own_row_and_cpu_estimates_have_no_table(cli_in_process):
    table = parallelism(cli_in_process, RUNS / "gpt2-small", "--gpu", "h100-sxm", "--num-gpus", "3")
    assert [r["gpus"] for r in table["rows"]] == [1, 2, 3, 4, 8, 16, 32, 64]
    assert row(table, 3)["note"] is not None  # 512 sequences do not split over 3 GPUs
    assert row(table, 64)["micro_batch_size"] == 8  # 512 sequences over 64 GPUs: 8 each, not train.json's 16
    assert parallelism(cli_in_process, RUNS / "demo", "--gpu", "cpu", "--peak-tflops", "0.1", "--mfu", "0.4") is None


def test_a_muon_run_is_offered_fsdp2_layouts_too(cli_in_process):
    """Muon runs under FSDP2 (its momentum sharded like AdamW's moments): a model too large for DDP gets FSDP2."""
    table = parallelism(cli_in_process, RUNS / "llama-3.2-1b", "--gpu-memory", "16GiB", "--gpu", "h100-sxm",
                        "--set", "optimizer=muon")
    assert row(table, 8)["fits"] and row(table, 8)["layout"]["parallelism"] == "fsdp"
