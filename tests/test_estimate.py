"""`nanopt estimate`: parameter counts, FLOPs, Chinchilla, time, cost, memory, the inverse question, --json."""

from __future__ import annotations

import json
import math

import pytest
from clihelp import REPO, assert_user_error, run_cli

from nanopt.config import ModelConfig, load_run
from nanopt.hardware import GPUS, parse_size
from nanopt.model.flops import count_params, flops_per_token
from nanopt.plan.estimate import EstimateOptions, estimate

PRESETS = sorted(p.name for p in (REPO / "runs").iterdir())
REQUIRED_KEYS = {"params", "non_embedding_params", "flops_per_token", "chinchilla_tokens", "train_tokens",
                 "total_flops", "train_seconds", "cost_usd", "memory_bytes", "max_micro_batch"}


def test_known_parameter_counts():
    gpt2 = load_run(REPO / "runs" / "gpt2-small").model
    llama = load_run(REPO / "runs" / "llama-3.2-1b").model
    assert count_params(gpt2).total == 124_475_904
    assert count_params(llama).total == 1_235_814_400


@pytest.mark.parametrize("preset", PRESETS)
def test_estimate_json_for_every_preset(preset):
    result = run_cli("estimate", f"runs/{preset}", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert REQUIRED_KEYS <= report.keys()
    assert {"weights", "gradients", "optimizer", "activations_per_sequence", "total"} <= report["memory_bytes"].keys()
    assert report["max_micro_batch"] >= 1


def test_palm_flops_formula_by_hand():
    cfg = ModelConfig(architecture="gpt2", vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, max_position_embeddings=1024)
    non_embedding = 124_439_808 - 50257 * 768 - 1024 * 768
    expected = 6 * (non_embedding + 50257 * 768) + 12 * 12 * 768 * 1024
    assert flops_per_token(cfg, 1024) == expected


def test_time_cost_and_inverse_question_are_consistent():
    run = load_run(REPO / "runs" / "gpt2-small")
    opts = EstimateOptions(gpu="a100-80gb", num_gpus=8, mfu=0.5, price_per_hour=2.0, hours=10)
    r = estimate(run, opts)
    peak = GPUS["a100-80gb"].bf16_tflops * 1e12
    assert r["total_flops"] == r["train_tokens"] * r["flops_per_token"]
    assert math.isclose(r["train_seconds"], r["total_flops"] / (8 * peak * 0.5))
    assert math.isclose(r["cost_usd"], r["train_seconds"] / 3600 * 8 * 2.0)
    tokens_in_10h = r["hours"]["tokens"]
    assert math.isclose(tokens_in_10h, 10 * 3600 * 8 * peak * 0.5 / r["flops_per_token"], rel_tol=1e-6)
    assert math.isclose(r["hours"]["fraction_of_chinchilla"], tokens_in_10h / r["chinchilla_tokens"])
    assert r["grad_accum"] == 524288 // (16 * 1024 * 8)


def test_fsdp_shards_states_and_checkpointing_shrinks_activations():
    run = load_run(REPO / "runs" / "llama-3.2-1b")
    ddp = estimate(run, EstimateOptions(num_gpus=8))["memory_bytes"]
    fsdp_run = load_run(REPO / "runs" / "llama-3.2-1b", {"parallelism": "fsdp", "activation_checkpointing": True})
    fsdp = estimate(fsdp_run, EstimateOptions(num_gpus=8))["memory_bytes"]
    assert fsdp["optimizer"] == math.ceil(ddp["optimizer"] / 8)
    assert fsdp["activations_per_sequence"] < ddp["activations_per_sequence"] / 3


def test_gpu_memory_override_lowers_the_predicted_micro_batch():
    run = load_run(REPO / "runs" / "gpt2-small")
    big = estimate(run, EstimateOptions(gpu="h100-sxm"))["max_micro_batch"]
    small = estimate(run, EstimateOptions(gpu="h100-sxm", gpu_memory=parse_size("40GiB")))["max_micro_batch"]
    assert 0 < small < big


def test_params_only_mode():
    result = run_cli("estimate", "--params", "7e9", "--gpu", "a100-80gb", "--num-gpus", "64", "--json")
    report = json.loads(result.stdout)
    assert report["params"] == 7_000_000_000
    assert report["chinchilla_tokens"] == 140_000_000_000
    assert report["flops_per_token"] == 42_000_000_000


def test_gpu_table_has_the_required_accelerators():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "a10", "rtx-3090",
            "rtx-4090"} <= GPUS.keys()


def test_human_table_renders():
    result = run_cli("estimate", "runs/gpt2-small", "--hours", "24")
    assert result.returncode == 0, result.stderr
    assert "124,475,904" in result.stdout and "predicted largest micro-batch" in result.stdout


def test_unknown_gpu_and_bad_options_are_user_errors():
    assert_user_error(run_cli("estimate", "runs/gpt2-small", "--gpu", "tpu-v5"), "unknown GPU 'tpu-v5'")
    assert_user_error(run_cli("estimate", "runs/gpt2-small", "--mfu", "1.5"), "--mfu")
    assert_user_error(run_cli("estimate", "runs/gpt2-small", "--gpu-memory", "lots"), "--gpu-memory")
    assert_user_error(run_cli("estimate"), "run directory or --params")


def test_help_lists_every_command_without_importing_torch():
    result = run_cli("--help")
    for command in ("tokenize", "estimate", "find-batch", "profile", "train", "eval", "export"):
        assert command in result.stdout
    import subprocess
    import sys
    probe = subprocess.run([sys.executable, "-c", "import sys; from nanopt.cli import app; "
                            "print('torch' in sys.modules, 'datasets' in sys.modules)"],
                           capture_output=True, text=True, cwd=REPO)
    assert probe.stdout.split() == ["False", "False"]


def test_train_json_price_per_hour_prices_the_estimate_unless_the_option_does():
    run = load_run(REPO / "runs" / "gpt2-small", {"price_per_hour": 1.5})
    r = estimate(run, EstimateOptions(gpu="h100-sxm", num_gpus=2))
    assert r["gpu"]["usd_per_hour"] == 1.5
    assert math.isclose(r["cost_usd"], r["train_hours"] * 2 * 1.5)
    assert estimate(run, EstimateOptions(gpu="h100-sxm", price_per_hour=2.0))["gpu"]["usd_per_hour"] == 2.0
    assert estimate(run, EstimateOptions(gpu="cpu"))["cost_usd"] is not None  # a priced CPU run costs money too
