"""Learning-rate schedules are pure functions of the step: warmup, cosine, WSD, constant."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from nanopt.config import TrainConfig
from nanopt.train.optim.optimizer import param_groups
from nanopt.train.optim.schedule import lr_at

BASE = TrainConfig(data="x", micro_batch_size=1, global_batch_tokens=1, max_steps=1000, learning_rate=1e-3,
                   min_lr_ratio=0.1, warmup_steps=100)


def cfg(**changes) -> TrainConfig:
    return dataclasses.replace(BASE, **changes)


def test_warmup_is_linear_and_never_zero():
    c = cfg()
    assert lr_at(0, 1000, c) == pytest.approx(1e-5)
    assert lr_at(49, 1000, c) == pytest.approx(5e-4)
    assert lr_at(99, 1000, c) == pytest.approx(1e-3)


def test_cosine_reaches_the_floor_exactly_at_the_last_step_and_is_monotone():
    c = cfg(lr_schedule="cosine")
    lrs = [lr_at(s, 1000, c) for s in range(100, 1000)]
    assert lrs[0] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    midpoint = 100 + (999 - 100) / 2
    assert lr_at(int(midpoint), 1000, c) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.4994)),
                                                          rel=1e-3)


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    c = cfg(lr_schedule="wsd", decay_fraction=0.2)
    assert lr_at(500, 1000, c) == pytest.approx(1e-3)
    assert lr_at(799, 1000, c) == pytest.approx(1e-3)
    assert lr_at(900, 1000, c) < 1e-3
    assert lr_at(999, 1000, c) == pytest.approx(1e-4)


def test_constant_after_warmup():
    c = cfg(lr_schedule="constant")
    assert lr_at(999, 1000, c) == pytest.approx(1e-3)


# Known values for 1001 steps (the last is step 1000), peak 1e-3, floor 1e-4, warmup 100: the cosine spans steps
# 100..1000, so steps 325, 550 and 775 are a quarter, half and three quarters of it; WSD decays over the last
# round(0.2 x 1001) = 200 steps, 800..1000. Worked out by hand from the docstring of lr_at, not by calling it.
R = math.sqrt(0.5)  # cos(pi / 4)
KNOWN_LRS = {
    "cosine": {0: 1e-5, 49: 5e-4, 98: 9.9e-4, 99: 1e-3, 100: 1e-3, 325: 1e-4 + 9e-4 * (1 + R) / 2, 550: 5.5e-4,
               775: 1e-4 + 9e-4 * (1 - R) / 2, 1000: 1e-4},
    "wsd": {0: 1e-5, 99: 1e-3, 100: 1e-3, 500: 1e-3, 799: 1e-3, 800: 1e-3, 850: 7.75e-4, 900: 5.5e-4, 950: 3.25e-4,
            1000: 1e-4},
    "constant": {0: 1e-5, 99: 1e-3, 100: 1e-3, 550: 1e-3, 1000: 1e-3},
}


def test_schedule_depends_only_on_step_so_resume_gets_the_same_lr():
    # A resumed run asks for the LR of step k first, an uninterrupted one after every step before k: both get the
    # closed-form value of step k, whatever was asked before (no hidden scheduler state, no off-by-one).
    queries = [(name, step) for name, known in KNOWN_LRS.items() for step in known]
    for order in (queries, list(reversed(queries)), sorted(queries, key=lambda q: (q[1] * 7919) % 1009)):
        for name, step in order:
            c = cfg(lr_schedule=name, decay_fraction=0.2)
            assert lr_at(step, 1001, c) == pytest.approx(KNOWN_LRS[name][step], rel=1e-12), (name, step)
    c = cfg(lr_schedule="cosine")
    uninterrupted = [lr_at(s, 1001, c) for s in range(1001)]
    resumed = [lr_at(s, 1001, c) for s in range(300, 1001)]
    assert resumed == uninterrupted[300:]


def test_weight_decay_skips_biases_and_norms():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0
