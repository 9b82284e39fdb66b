"""`nanopt estimate --flops C`: the compute-optimal parameters and tokens (C = 6ND, D = ratio x N), the model shape
planned for them, its exact parameter count, and the model.json it writes."""

from __future__ import annotations

import json

import torch
from clihelp import assert_user_error, run_cli

from nanopt.config import load_model_config
from nanopt.model.flops import count_params
from nanopt.model.transformer import Transformer
from nanopt.plan.estimate import EstimateOptions, estimate
from nanopt.plan.estimate.budget import compute_optimal


def test_compute_optimal_split_of_1e21_flops():
    # N = sqrt(1e21 / 120) = 2,886,751,345.95 -> 2,886,751,346; D = 20 N
    optimum = compute_optimal(1e21, 20.0)
    assert (optimum.params, optimum.tokens) == (2_886_751_346, 57_735_026_920)
    # over-training 100 tokens per parameter: a smaller model on more tokens
    over = compute_optimal(1e21, 100.0)
    assert (over.params, over.tokens) == (1_290_994_449, 129_099_444_900)


def test_planned_gpt2_shape_and_its_exact_count():
    report = estimate(None, EstimateOptions(flops=1e21, family="gpt2", gpu="h100-sxm", num_gpus=8, mfu=0.4))
    model = report["model"]
    assert (model["num_hidden_layers"], model["hidden_size"], model["num_attention_heads"]) == (39, 2432, 38)
    assert report["model_params"] == 2_894_111_616
    assert abs(report["model_params_vs_optimal"] - 1) <= 0.02
    # C FLOPs on 8 H100s (989.4 TFLOP/s dense bf16) at 40% MFU
    assert abs(report["train_seconds"] - 1e21 / (8 * 989.4e12 * 0.4)) < 1e-6


def test_planned_shape_count_is_the_built_models(tmp_path):
    report = estimate(None, EstimateOptions(flops=1e15, family="llama", mfu=0.4))
    path = tmp_path / "model.json"
    path.write_text(json.dumps(report["model"]))
    cfg = load_model_config(path)
    with torch.device("meta"):
        built = Transformer(cfg)
    assert sum(p.numel() for p in built.parameters()) == report["model_params"] == count_params(cfg).total
    # the grouping of the family's template (Llama 3.2: 4 queries per KV head) holds
    assert cfg.num_attention_heads == 4 * cfg.num_key_value_heads


def test_run_directory_gives_the_family(tmp_path):
    report = estimate(None, EstimateOptions(flops=1e15, family="gpt2", mfu=0.4))
    assert report["model"]["architecture"] == "gpt2" and report["model"]["vocab_size"] == 50304
    result = run_cli("estimate", "runs/demo", "--flops", "1e15", "--json")
    assert result.returncode == 0, result.stderr
    planned = json.loads(result.stdout)
    demo = planned["model"]
    assert (demo["architecture"], demo["vocab_size"], demo["max_position_embeddings"]) == ("llama", 1024, 256)
    assert demo["num_attention_heads"] == 2 * demo["num_key_value_heads"]  # the demo's grouping
    # a budget this small still gets a model near its optimum (widths step by a head group, not a fixed 256)
    small = json.loads(run_cli("estimate", "runs/demo", "--flops", "3e13", "--json").stdout)
    assert small["optimal_params"] == 500_000 and abs(small["model_params_vs_optimal"] - 1) <= 0.1


def test_write_model_writes_a_loadable_model_json_once(tmp_path):
    target = tmp_path / "new-run" / "model.json"  # a new run directory is made for it
    result = run_cli("estimate", "--flops", "1e18", "--family", "gpt2", "--write-model", target)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "compute-optimal parameters" in result.stdout
    cfg = load_model_config(target)
    assert count_params(cfg).total == json.loads(run_cli("estimate", "--flops", "1e18", "--family", "gpt2",
                                                         "--json").stdout)["model_params"]
    before = target.read_bytes()
    assert_user_error(run_cli("estimate", "--flops", "1e18", "--write-model", target), "already exists")
    assert target.read_bytes() == before


def test_bad_budget_options_are_one_line_errors(tmp_path):
    assert_user_error(run_cli("estimate", "--flops", "1e21", "--params", "1e9"), "--flops with --params")
    assert_user_error(run_cli("estimate", "--flops", "nan"), "--flops")
    assert_user_error(run_cli("estimate", "--flops", "1e21", "--family", "mamba"), "--family 'mamba'")
    assert_user_error(run_cli("estimate", "runs/demo", "--flops", "1e21", "--family", "gpt2"), "--family")
    assert_user_error(run_cli("estimate", "runs/demo", "--write-model", tmp_path / "m.json"), "--write-model")
    (tmp_path / "file").write_text("")
    result = run_cli("estimate", "--flops", "1e21", "--write-model", tmp_path / "file" / "m.json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert not (tmp_path / "m.json").exists()
