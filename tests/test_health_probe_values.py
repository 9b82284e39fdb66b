"""Run health's per-block gradient norms and per-group update-to-parameter ratios (what metrics.jsonl's
`grad_norm_blocks` and `update_ratio` hold, and the health chart draws) are each block's and each group's own values:
after one real optimizer step on a tiny model, they equal a plain float64 computation from the parameters' .grad
(before clipping) and the weights before and after the step. A total that adds up is not enough: every block, the
last layers included, is checked on its own."""

from __future__ import annotations

import math

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.config.schema import TrainConfig
from nanopt.model.transformer import Transformer
from nanopt.train.health.probe import HealthProbe
from nanopt.train.optim.optimizer import build_optimizer

LAYERS = 4
CASES = {
    "adamw-llama-tied": ({"architecture": "llama"}, "adamw"),
    "adamw-gpt2-untied": ({"architecture": "gpt2", "tie_word_embeddings": False}, "adamw"),
    "muon-llama": ({"architecture": "llama"}, "muon"),
}


def block_name(name: str) -> str:
    """`layers.2.mlp.up_proj.weight` -> `layers.2`; any other parameter is its own top-level module's block."""
    parts = name.split(".")
    return f"layers.{parts[1]}" if parts[0] == "layers" else parts[0]


def group_name(name: str, param: torch.Tensor, optimizer: str) -> str:
    """AdamW decays matrices and embeddings, not gains and biases; Muon takes the 2-D weights inside the blocks."""
    if optimizer == "muon" and name.startswith("layers.") and param.dim() == 2:
        return "muon"
    return "decay" if param.dim() >= 2 else "no_decay"


def root_sums(values: dict[str, list[float]]) -> dict[str, float]:
    return {key: math.sqrt(sum(parts)) for key, parts in values.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_block_gradient_norms_and_group_update_ratios_are_each_ones_own(case: str):
    model_options, optimizer_name = CASES[case]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, **model_options)
    model = Transformer(cfg)
    train = TrainConfig(data="d", micro_batch_size=2, global_batch_tokens=32, learning_rate=1e-2,
                        optimizer=optimizer_name, grad_clip=0.5)
    optimizer = build_optimizer(model, train, torch.device("cpu"))
    probe = HealthProbe(model, optimizer, None)

    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    named = list(model.named_parameters())  # tied weights once, as the model has them
    # The reference, before the probe or clipping touch anything: float64 copies of each gradient and weight.
    grads = {name: p.grad.detach().double().clone() for name, p in named}
    before = {name: p.detach().double().clone() for name, p in named}

    # A log step's order (nanopt.train.step): the probe reads the gradients before clipping, the weights around
    # the update.
    probe.gradients()
    torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip, foreach=True)
    probe.before_update()
    optimizer.step()
    probe.after_update()
    signals = probe.read()

    squares: dict[str, list[float]] = {}
    for name, _ in named:
        squares.setdefault(block_name(name), []).append(float((grads[name] ** 2).sum()))
    expected_blocks = root_sums(squares)
    layers = [f"layers.{i}" for i in range(LAYERS)]
    outside = {"embed_tokens", "norm"} | ({"embed_positions", "lm_head"} if case == "adamw-gpt2-untied" else set())
    assert set(expected_blocks) == outside | set(layers)  # the reference's own blocks, as the model is built

    reported = signals["grad_norm_blocks"]
    assert set(reported) == set(expected_blocks)
    for block, norm in expected_blocks.items():
        assert norm > 0, block
        assert reported[block] == pytest.approx(norm, rel=1e-5), block
    # Different blocks, different norms: each block's own, not a copy of another's.
    assert len({round(reported[layer], 9) for layer in layers}) == LAYERS

    updates: dict[str, list[float]] = {}
    weights: dict[str, list[float]] = {}
    for name, p in named:
        after = p.detach().double()
        group = group_name(name, p, optimizer_name)
        updates.setdefault(group, []).append(float(((after - before[name]) ** 2).sum()))
        weights.setdefault(group, []).append(float((after ** 2).sum()))
    update_norms, weight_norms = root_sums(updates), root_sums(weights)
    expected_ratios = {group: update_norms[group] / weight_norms[group] for group in updates}
    assert set(expected_ratios) == ({"decay", "no_decay", "muon"} if optimizer_name == "muon"
                                    else {"decay", "no_decay"})
    assert signals["update_ratio"] == pytest.approx(expected_ratios, rel=1e-4)
    assert all(ratio > 0 for ratio in expected_ratios.values())
