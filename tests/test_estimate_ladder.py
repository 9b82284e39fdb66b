"""`nanopt estimate`'s memory ladder: every rung (parallelism x activation checkpointing) at the run's GPU count with
its memory and projected slowdown, the fastest that fits recommended, for the three cases it was made for (a 1B
Llama on one 24 GB GPU, an 8B Llama on eight 40 GB GPUs, GPT-2 small on a T4); and `--compare-gpus`.

The oracle for "fits" is the estimate's own memory verdict for the run with that rung set in train.json (--set):
the ladder and the verdict must never disagree. The oracle for "fastest" is the table's own slowdown column: no
faster rung fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import REPO, assert_user_error

from nanopt.config import load_run
from nanopt.hardware import GIB, GPUS
from nanopt.model.flops import count_params
from nanopt.plan.estimate import EstimateOptions, estimate

RUNS = REPO / "runs"

LLAMA_8B = {"architecture": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False}
LLAMA_8B_TRAIN = {"data": "data", "micro_batch_size": 1, "global_batch_tokens": 4194304, "train_tokens": "160B"}


def ladder_of(cli, run: Path, *args: object) -> dict:
    result = cli("estimate", run, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def check_against_the_verdict(run: Path, ladder: dict, gpu: str) -> None:
    """Each rung fits exactly when the estimate's verdict says the run with it set fits; the recommended rung is
    the fastest that fits."""
    for rung in ladder["rows"]:
        settings = {"parallelism": rung["parallelism"], "activation_checkpointing": rung["activation_checkpointing"],
                    "optimizer": rung["optimizer"], "micro_batch_size": rung["micro_batch_size"]}
        verdict = estimate(load_run(run, settings), EstimateOptions(gpu=gpu, num_gpus=ladder["gpus"]))["fit"]
        assert verdict["fits"] == rung["fits"], (rung, verdict["verdict"])
    slowdowns = [rung["slowdown"] for rung in ladder["rows"]]
    assert slowdowns == sorted(slowdowns)
    recommended = ladder["recommended"]
    assert recommended is not None and recommended["fits"]
    assert not any(r["fits"] for r in ladder["rows"] if r["slowdown"] < recommended["slowdown"])


def test_a_1b_llama_on_one_24gb_gpu_with_ecc_needs_8bit_adamw_moments(cli_in_process):
    # An L4's 24 GB of GDDR6 reads 22.5 GiB with ECC on (its default); a 4090's, without ECC, 24.0, where plain DDP
    # fits at micro-batch 1.
    report = ladder_of(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "l4", "--num-gpus", "1")
    ladder = report["ladder"]
    # One process shards nothing: DDP's rungs only.
    assert {r["parallelism"] for r in ladder["rows"]} == {"ddp"}
    check_against_the_verdict(RUNS / "llama-3.2-1b", ladder, "l4")
    # fp32 weights, gradients and AdamW moments alone are 16 bytes a parameter, 18.4 GiB of the card's 22.5 GiB, and
    # a log step's update holds run health's copy of the weights too (4 more: 23.0 GiB): no rung with 32-bit
    # moments fits, however much it recomputes; 8-bit moments (10 bytes a parameter, 14 at that update) leave room
    # without any recomputation.
    assert 16 * count_params(load_run(RUNS / "llama-3.2-1b").model).total > 18 * GIB
    assert not [r for r in ladder["rows"] if r["fits"] and r["optimizer"] == "adamw"]
    recommended = ladder["recommended"]
    assert (recommended["parallelism"], recommended["activation_checkpointing"], recommended["optimizer"]) == \
        ("ddp", False, "adamw8bit")


def test_an_8b_llama_on_eight_40gb_gpus_needs_sharded_weights(cli_in_process, tmp_path: Path):
    run = tmp_path / "llama-8b"
    run.mkdir()
    (run / "model.json").write_text(json.dumps(LLAMA_8B))
    (run / "train.json").write_text(json.dumps(LLAMA_8B_TRAIN))
    ladder = ladder_of(cli_in_process, run, "--gpu", "a100-40gb", "--num-gpus", "8")["ladder"]
    check_against_the_verdict(run, ladder, "a100-40gb")
    params = count_params(load_run(run).model).total
    # Replicated weights and gradients (DDP 16, ZeRO-1 4 + 4 + 8/8 bytes a parameter) exceed 40 GiB by themselves.
    assert 9 * params > 40 * GIB
    assert not any(r["fits"] for r in ladder["rows"] if r["parallelism"] in ("ddp", "zero1"))
    assert ladder["recommended"]["parallelism"] in ("zero2", "fsdp", "fsdp_offload")
    # Host memory per GPU: weights, gradients and the moments (8 bytes a parameter, 8-bit: 2 + 1/32) over 8 ranks,
    # and run health's copy of the weights at a log step's update (4).
    host = {"adamw": 16 + 4, "adamw8bit": 10 + 1 / 32 + 4}
    offload = [r for r in ladder["rows"] if r["parallelism"] == "fsdp_offload"]
    assert {r["optimizer"] for r in offload} == set(host)  # 8-bit AdamW is offered sharded and offloaded too
    assert all(r["host_bytes"] == pytest.approx(host[r["optimizer"]] * params / 8, rel=1e-6) for r in offload)
    assert {r["optimizer"] for r in ladder["rows"] if r["parallelism"] in ("zero2", "fsdp")} == set(host)
    assert not any(r["optimizer"] == "adamw8bit" for r in ladder["rows"] if r["parallelism"] == "zero1")


def test_gpt2_small_on_a_t4_trains_in_fp16_with_plain_ddp(cli_in_process):
    report = ladder_of(cli_in_process, RUNS / "gpt2-small", "--gpu", "t4", "--compare-gpus")
    ladder = report["ladder"]
    assert not GPUS["t4"].bf16 and ladder["precision"] == "fp16"  # `precision: auto` without bf16: fp16
    check_against_the_verdict(RUNS / "gpt2-small", ladder, "t4")
    assert (ladder["recommended"]["parallelism"], ladder["recommended"]["activation_checkpointing"]) == ("ddp", False)

    compared = report["compare_gpus"]["rows"]
    assert {r["gpu"] for r in compared} == set(GPUS)
    [t4] = [r for r in compared if r["gpu"] == "t4"]
    assert t4["precision"] == "fp16" and t4["rung"]["name"] == ladder["recommended"]["name"]
    per_token = [r["usd_per_million_tokens"] for r in compared if r["fits"]]
    assert per_token == sorted(per_token)
    # Each card's time is the train FLOPs at its peak and the assumed MFU, slowed by its rung.
    [h100] = [r for r in compared if r["gpu"] == "h100-sxm"]
    peak = GPUS["h100-sxm"].peak_flops("bf16")
    expected = report["total_flops"] / (peak * report["compare_gpus"]["mfu"]) * h100["rung"]["slowdown"]
    assert h100["train_seconds"] == pytest.approx(expected)
    assert h100["usd_per_million_tokens"] == pytest.approx(
        h100["train_seconds"] / 3600 * GPUS["h100-sxm"].usd_per_hour / (report["train_tokens"] / 1e6))


def test_the_ladder_and_the_comparison_are_printed(cli_in_process):
    result = cli_in_process("estimate", RUNS / "gpt2-small", "--gpu", "a100-40gb", "--num-gpus", "8",
                            "--compare-gpus")
    assert result.returncode == 0, result.stderr
    assert "memory ladder on 8 GPUs" in result.stdout and "FSDP2 + CPU offload" in result.stdout
    assert "recommended: DDP" in result.stdout and "--set parallelism=ddp" in result.stdout
    assert "$ / M tokens" in result.stdout and "v100-16gb" in result.stdout


@pytest.mark.parametrize("args", [("--params", "7e9"), (RUNS / "demo", "--gpu", "cpu")])
def test_compare_gpus_without_a_run_or_on_the_cpu_is_a_one_line_error(cli_in_process, args):
    assert_user_error(cli_in_process("estimate", *args, "--compare-gpus"), "--compare-gpus needs a run directory")


def test_a_muon_run_is_offered_only_the_layouts_muon_runs_with(cli_in_process):
    ladder = ladder_of(cli_in_process, RUNS / "llama-3.2-1b", "--gpu", "rtx-4090", "--num-gpus", "4",
                       "--set", "optimizer=muon")["ladder"]
    assert {r["parallelism"] for r in ladder["rows"]} == {"ddp", "zero2", "fsdp"}
    assert {r["optimizer"] for r in ladder["rows"]} == {"muon"}
    check_against_the_verdict(RUNS / "llama-3.2-1b", ladder, "rtx-4090")


def printed_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with `header`, split on runs of two spaces or more."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [header]) + 2  # past the rule
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_a_small_run_compared_shows_each_cost_and_piped_tables_are_whole(cli_in_process,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """The demo trains in well under a second on any card: its time and cost still read (not 0.0s and $0.0000),
    cheapest first; and in a terminal of 80 columns no table cuts a cell short."""
    monkeypatch.setenv("COLUMNS", "80")
    result = cli_in_process("estimate", RUNS / "demo", "--gpu", "h100-sxm", "--compare-gpus")
    assert result.returncode == 0, result.stderr
    assert "\u2026" not in result.stdout, result.stdout  # rich's ellipsis: a cell cut short
    rows = printed_rows(result.stdout, "GPU")
    assert {row[0] for row in rows} == set(GPUS)
    per_token = [float(row[-1].lstrip("$")) for row in rows]
    assert all(cost > 0 for cost in per_token) and per_token == sorted(per_token)
    assert all(float(row[-2].lstrip("$")) > 0 and row[-3] != "0.0s" for row in rows)
