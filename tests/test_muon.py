"""`"optimizer": "muon"`: Muon on the hidden matrices, AdamW on the rest; trains, resumes bit-exactly, agrees over
2 DDP ranks, is counted by the memory model, and bad values are one-line errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from faulthelp import tiny_run, tree_digest
from trainhelp import final_weights_hash, losses

from nanopt.config import load_run
from nanopt.errors import ConfigError
from nanopt.model.transformer import Transformer
from nanopt.train.optim import build_optimizer, set_lr

MUON = {"optimizer": "muon", "muon_learning_rate": 0.02, "learning_rate": 3e-3}


def _hidden_matrices(model: torch.nn.Module) -> set[str]:
    """The oracle: every 2-D weight inside a transformer block (attention and MLP projections)."""
    return {name for name, p in model.named_parameters() if name.startswith("layers.") and p.dim() == 2}


def _names(model: torch.nn.Module, optimizer) -> dict[str, set[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {kind: {by_id[id(p)] for group in opt.param_groups for p in group["params"]}
            for kind, opt in (("muon", optimizer.muon), ("adamw", optimizer.adamw))}


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_hidden_matrices_go_to_muon_everything_else_to_adamw(tmp_path: Path, tiny_dataset: Path, architecture: str):
    run = load_run(tiny_run(tmp_path, tiny_dataset, "run", **MUON))
    model_cfg = {**run.model.to_dict(), "architecture": architecture, "tie_word_embeddings": False,
                 "attention_bias": architecture == "gpt2", "mlp_bias": architecture == "gpt2"}
    model = Transformer(type(run.model)(**model_cfg))
    optimizer = build_optimizer(model, run.train, torch.device("cpu"))
    names = _names(model, optimizer)
    assert names["muon"] == _hidden_matrices(model) and names["muon"]
    assert names["adamw"] == {name for name, _ in model.named_parameters()} - names["muon"]
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= names["adamw"]

    # The schedule sets the AdamW LR; Muon's keeps its own base LR scaled by the same factor.
    set_lr(optimizer, run.train.learning_rate * 0.25)
    assert all(g["lr"] == pytest.approx(0.02 * 0.25) for g in optimizer.muon.param_groups)
    assert all(g["lr"] == pytest.approx(3e-3 * 0.25) for g in optimizer.adamw.param_groups)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)  # what metrics.jsonl logs as "lr"


def test_muon_trains_and_a_resume_is_bit_exact(tmp_path: Path, tiny_dataset: Path, launcher):
    straight = tiny_run(tmp_path, tiny_dataset, "straight", **MUON, max_steps=20, checkpoint_interval=10,
                        eval_interval=0)
    launcher.train(straight)
    loss = losses(straight)
    assert sum(list(loss.values())[-3:]) / 3 < loss[1] - 0.2, loss  # it learns

    resumed = tiny_run(tmp_path, tiny_dataset, "resumed", **MUON, max_steps=20, checkpoint_interval=10,
                       eval_interval=0)
    (resumed / "checkpoints").mkdir()
    shutil.copytree(straight / "checkpoints" / "step-000010", resumed / "checkpoints" / "step-000010")
    child = launcher.train(resumed)
    assert "resumed from" in child.stderr, child.stderr[-2000:]
    assert final_weights_hash(resumed) == final_weights_hash(straight)


def test_two_ddp_ranks_train_like_one_process(tmp_path: Path, tiny_dataset: Path, launcher):
    # 2 ranks x accumulation 1 see the same samples as 1 rank x accumulation 2: the same losses, to rounding.
    one = tiny_run(tmp_path, tiny_dataset, "one", **MUON, max_steps=6, checkpoint_interval=0, eval_interval=0)
    two = tiny_run(tmp_path, tiny_dataset, "two", **MUON, max_steps=6, checkpoint_interval=0, eval_interval=0)
    launcher.train(one)
    launcher.train(two, "--nproc-per-node", "2")
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys() and len(a) == 6
    assert all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)


@pytest.mark.parametrize(("values", "fragments"), [
    ({"optimizer": "sgd"}, ("optimizer", "'sgd'", "muon")),
    ({"optimizer": "muon", "muon_learning_rate": 0}, ("muon_learning_rate",)),
    ({"optimizer": "muon", "muon_learning_rate": -0.02}, ("muon_learning_rate",)),
    ({"optimizer": "muon", "parallelism": "fsdp"}, ("optimizer", "muon", "parallelism", "fsdp")),
])
def test_bad_values_are_one_line_errors_and_write_nothing(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                          values: dict, fragments: tuple):
    run = tiny_run(tmp_path, tiny_dataset, "run", **values)
    before = tree_digest(run)
    assert_user_error(cli_in_process("train", run, "--no-live"), *fragments)
    assert tree_digest(run) == before


def test_a_torch_without_muon_is_one_clear_error(tmp_path: Path, tiny_dataset: Path, monkeypatch):
    run = load_run(tiny_run(tmp_path, tiny_dataset, "run", **MUON))
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match="torch.optim.Muon") as raised:
        build_optimizer(Transformer(run.model), run.train, torch.device("cpu"))
    assert raised.value.hint


def test_estimate_counts_one_momentum_buffer_for_the_muon_matrices(tmp_path: Path, tiny_dataset: Path,
                                                                  cli_in_process):
    reports = {}
    for optimizer in ("adamw", "muon"):
        run = tiny_run(tmp_path, tiny_dataset, optimizer, optimizer=optimizer)
        result = cli_in_process("estimate", run, "--gpu", "h100-sxm", "--num-gpus", "1", "--json")
        assert result.returncode == 0, result.stderr
        reports[optimizer] = json.loads(result.stdout)["memory_bytes"]["optimizer"]
    model = Transformer(load_run(tmp_path / "muon").model)
    matrices = sum(p.numel() for name, p in model.named_parameters() if name in _hidden_matrices(model))
    total = sum(p.numel() for p in model.parameters())
    assert reports["adamw"] == 8 * total
    assert reports["muon"] == 8 * total - 4 * matrices  # AdamW's two moments become Muon's one buffer
    assert not math.isclose(reports["muon"], reports["adamw"])


def test_optimizer_cannot_change_on_resume(tmp_path: Path, tiny_dataset: Path, launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, checkpoint_interval=2, eval_interval=0)
    launcher.train(run)
    train = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**train, "optimizer": "muon", "max_steps": 4}))
    child = launcher.run("train", run, "--no-live", "--allow-changed")
    assert child.status == 2, child.stderr[-2000:]
    assert "cannot resume" in child.stderr and "train.optimizer: 'adamw' -> 'muon'" in child.stderr, child.stderr

