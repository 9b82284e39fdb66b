"""Run health's arithmetic (nanopt.train.health) on synthetic series: each verdict is reached where it should be,
once, and a healthy series reaches none."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from nanopt.train.health import (
    HealthMonitor,
    HealthSettings,
    initial_loss_verdict,
    loss_trend,
    replay,
)

SETTINGS = HealthSettings(token_rows=1024, total_steps=1000, warmup_steps=20, grad_clip=1.0, log_interval=1)


def feed(monitor: HealthMonitor, steps: range, loss, ratio=lambda step: 1e-3, norm=lambda step: 0.5,
         clipped=lambda step: 0.0, lr=lambda step: 1e-3) -> list:
    """Feed one train record per step; every verdict returned, with the step it came at."""
    reached = []
    for step in steps:
        record = {"step": step, "loss": loss(step), "grad_norm": norm(step), "clipped_fraction": clipped(step),
                  "lr": lr(step), "update_ratio": {"decay": ratio(step), "no_decay": ratio(step) / 10}}
        reached += monitor.observe(record)
    return reached


def noisy(mean, sd: float = 0.05, seed: int = 0):
    rng = random.Random(seed)
    return lambda step: mean(step) + rng.gauss(0, sd)


def healthy_loss(step: int) -> float:
    """A loss that keeps falling, fast then slowly, as a pretraining loss does."""
    return 3.0 + 3.9 * math.exp(-step / 150) + 0.6 * (1 - step / 1000)


def test_initial_loss_near_ln_vocab_is_fine_and_far_off_is_a_verdict():
    assert initial_loss_verdict(math.log(1024) + 0.3, 1024) is None
    assert initial_loss_verdict(math.log(1024) - 0.9, 1024) is None
    high = initial_loss_verdict(25.0, 1024)
    assert high is not None and high.name == "initial_loss" and "above" in high.message
    assert "initializer_range" in high.advice and "tokenizer" in high.advice
    low = initial_loss_verdict(2.0, 1024)
    assert low is not None and "below" in low.message
    assert initial_loss_verdict(float("nan"), 1024) is not None


def test_loss_trend_of_a_straight_line():
    change, error = loss_trend([(step, 10.0 - 0.01 * step) for step in range(0, 101, 10)])
    assert change == pytest.approx(-1.0 / 9.5)  # 10 -> 9 over the span, mean 9.5
    assert error == pytest.approx(0.0, abs=1e-12)
    assert loss_trend([(1, 5.0), (2, 4.0)]) is None  # too few points


def test_window_is_scaled_to_the_run_and_the_log_interval():
    assert SETTINGS.window_steps == 250  # a quarter of the run
    assert HealthSettings(1024, 30, 0, 1.0, 1).window_steps == 10
    assert HealthSettings(1024, 10**6, 0, 1.0, 1).window_steps == 1000
    assert HealthSettings(1024, 1200, 50, 1.0, 10).window_steps == 300  # the demo
    assert HealthSettings(1024, 200, 0, 1.0, 10).window_steps == 100  # ten logged records at the least


def test_a_healthy_run_reaches_no_verdict():
    monitor = HealthMonitor(SETTINGS)
    assert feed(monitor, range(1, 1001), noisy(healthy_loss)) == []
    assert monitor.summary()["verdicts"] == []
    assert monitor.summary()["signals"]["loss_trend"] < 0


def test_a_flat_loss_is_a_plateau_announced_once():
    monitor = HealthMonitor(SETTINGS)
    reached = feed(monitor, range(1, 1001), noisy(lambda step: 6.9))
    assert [v.name for v in reached] == ["plateau"]
    assert SETTINGS.judging_from <= reached[0].step <= 400
    assert "learning_rate" in reached[0].advice


def test_a_loss_that_stops_falling_is_a_plateau_after_it_stops():
    monitor = HealthMonitor(SETTINGS)
    reached = feed(monitor, range(1, 1501), noisy(lambda step: healthy_loss(min(step, 500))))
    assert [v.name for v in reached] == ["plateau"]
    assert 500 < reached[0].step <= 1200  # two windows of 250 steps, then half of one


def test_a_tiny_update_ratio_is_stagnation():
    reached = feed(HealthMonitor(SETTINGS), range(1, 300), noisy(healthy_loss), ratio=lambda step: 2e-6)
    assert [v.name for v in reached] == ["stagnating_updates"]
    assert reached[0].step == SETTINGS.judging_from  # low all along: said as soon as judging starts
    assert "1e-3" in reached[0].message


def test_a_collapsing_update_ratio_is_stagnation_but_a_decaying_learning_rate_is_not():
    lr = lambda step: 1e-3 * (1 - step / 1200)  # noqa: E731
    falls_with_lr = feed(HealthMonitor(SETTINGS), range(1, 1001), noisy(healthy_loss),
                         ratio=lambda step: 2 * lr(step), lr=lr)
    assert falls_with_lr == []
    collapsed = feed(HealthMonitor(SETTINGS), range(1, 1001), noisy(healthy_loss),
                     ratio=lambda step: 2e-3 if step < 400 else 1e-5 * 1.5, lr=lambda step: 1e-3)
    assert [v.name for v in collapsed] == ["stagnating_updates"]
    assert 400 <= collapsed[0].step < 410


def test_clipping_on_most_steps_is_exploding_gradients():
    reached = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss), clipped=lambda step: 0.8)
    assert [v.name for v in reached] == ["exploding_gradients"]
    assert reached[0].step == SETTINGS.judging_from  # early clipping is no verdict: the warmup is unruly
    assert "80%" in reached[0].message


def test_a_growing_gradient_norm_without_clipping_is_exploding_gradients():
    settings = HealthSettings(1024, 1000, 20, 0.0, 1)
    reached = feed(HealthMonitor(settings), range(1, 1001), noisy(healthy_loss),
                   norm=lambda step: 0.5 if step < 500 else 0.5 * 1.05 ** (step - 500), clipped=lambda step: None)
    assert [v.name for v in reached] == ["exploding_gradients"]
    assert 500 < reached[0].step < 800


def test_a_verdict_already_announced_is_not_announced_again():
    monitor = HealthMonitor(SETTINGS, announced={"plateau"})
    assert feed(monitor, range(1, 1001), noisy(lambda step: 6.9)) == []


def test_step_counts_give_the_clipped_fraction_and_the_first_steps_check():
    monitor = HealthMonitor(SETTINGS)
    assert [v.name for v in monitor.observe_step(1, 30.0, 5.0)] == ["initial_loss"]
    for step in range(2, 11):
        assert monitor.observe_step(step, 6.0, 2.0 if step % 2 else 0.5) == []
    assert monitor.clipped_fraction() == pytest.approx(0.5)  # steps 1, 3, 5, 7, 9 of 10
    assert monitor.clipped_fraction() is None  # no step since
    assert HealthMonitor(HealthSettings(1024, 100, 0, 0.0)).clipped_fraction() is None  # clipping off


def test_replay_reads_recorded_events_and_judges_train_records_after_a_rollback():
    records = [{"kind": "event", "event": "health", "verdict": "initial_loss", "step": 1, "message": "m",
                "advice": "a"}]
    rng = random.Random(1)
    for step in range(1, 600):
        records.append({"kind": "train", "step": step, "loss": healthy_loss(step) + rng.gauss(0, 0.05),
                        "grad_norm": 0.4})
    for step in range(300, 1001):  # rolled back to step 300, then flat
        records.append({"kind": "train", "step": step, "loss": 6.0 + rng.gauss(0, 0.05), "grad_norm": 0.4})
    monitor = replay(records, SETTINGS)
    names = [v["name"] for v in monitor.summary()["verdicts"]]
    assert names == ["initial_loss", "plateau"]
    assert monitor.summary()["signals"]["step"] == 1000


DEMO_RECORDS = Path(__file__).parent / "golden" / "demo_train_records.jsonl"


def test_the_demos_healthy_run_reaches_no_verdict():
    """The train records (loss, grad norms, clipped share, update ratios) of runs/demo trained to its 1200 steps on
    a CPU, replayed: the run the README's healthy figures come from is judged healthy."""
    records = [json.loads(line) for line in DEMO_RECORDS.read_text().splitlines()]
    demo = json.loads((Path(__file__).parents[1] / "runs" / "demo" / "train.json").read_text())
    settings = HealthSettings(token_rows=1024, total_steps=demo["max_steps"], warmup_steps=demo["warmup_steps"],
                              grad_clip=demo["grad_clip"], log_interval=demo["log_interval"])
    monitor = replay(records, settings)
    assert monitor.summary()["verdicts"] == []
    last = monitor.summary()["signals"]
    assert last["step"] == 1200 and 1e-4 < last["update_ratio"]["decay"] < 1e-2
