"""Run health's arithmetic (nanopt.train.health.verdicts) on synthetic series: each verdict is reached where it should
be, once, with the numbers it saw; a healthy series reaches none; the verdicts do not depend on how often a run logs;
and a replay of what the run wrote reaches the verdicts training reached."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from nanopt.train.health.verdicts import (
    HealthMonitor,
    HealthSettings,
    initial_loss_verdict,
    loss_trend,
    replay,
)

SETTINGS = HealthSettings(token_rows=1024, total_steps=1000, warmup_steps=20, grad_clip=1.0)


def feed(monitor: HealthMonitor, steps: range, loss, ratio=lambda step: 1e-3, norm=lambda step: 0.5,
         lr=lambda step: 1e-3, log_interval: int = 1, written: list | None = None) -> list:
    """Train as the loop does: every step's loss and norm, a train record every `log_interval` steps and at the
    last. `written` gets what metrics.jsonl would hold (each verdict's event, then the train records). Returns
    every verdict reached."""
    reached = []
    for step in steps:
        fresh = monitor.observe_step(step, loss(step), norm(step))
        reached += fresh
        for v in fresh:
            (written if written is not None else []).append(
                {"kind": "event", "event": "health", "step": v.step, "verdict": v.name, "message": v.message,
                 "advice": v.advice, "evidence": v.evidence})
        if step % log_interval == 0 or step == steps[-1]:
            record = {"kind": "train", "step": step, "loss": loss(step), "grad_norm": norm(step), "lr": lr(step),
                      "update_ratio": {"decay": ratio(step), "no_decay": ratio(step) / 10},
                      "health_blocks": monitor.take_pending()}
            monitor.observe(record)
            if written is not None:
                written.append(json.loads(json.dumps(record)))
    return reached


def noisy(mean, sd: float = 0.05, seed: int = 0):
    rng = random.Random(seed)
    return lambda step: mean(step) + rng.gauss(0, sd)


def healthy_loss(step: int) -> float:
    """A loss that keeps falling, fast then slowly, as a pretraining loss does."""
    return 3.0 + 3.9 * math.exp(-step / 150) + 0.6 * (1 - step / 1000)


def first_judged(settings: HealthSettings = SETTINGS) -> int:
    """The first block's end at or after the warmup and one window: where judging starts."""
    block = settings.block_steps
    return -(-settings.judging_from // block) * block


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


def test_the_window_is_scaled_to_the_run_and_not_to_the_log_interval():
    assert SETTINGS.window_steps == 250  # a quarter of the run
    assert HealthSettings(1024, 30, 0, 1.0).window_steps == 10
    assert HealthSettings(1024, 10**6, 0, 1.0).window_steps == 1000
    assert HealthSettings(1024, 1200, 50, 1.0).window_steps == 300  # the demo
    assert "log_interval" not in HealthSettings.__dataclass_fields__


def test_a_healthy_run_reaches_no_verdict():
    monitor = HealthMonitor(SETTINGS)
    assert feed(monitor, range(1, 1001), noisy(healthy_loss)) == []
    assert monitor.summary()["verdicts"] == []
    assert monitor.summary()["signals"]["loss_trend"] < 0


def test_a_flat_loss_is_a_plateau_announced_once_with_what_it_saw():
    monitor = HealthMonitor(SETTINGS)
    reached = feed(monitor, range(1, 1001), noisy(lambda step: 6.9))
    assert [v.name for v in reached] == ["plateau"]
    verdict = reached[0]
    # Judged once both windows hold five blocks (step 375), and flat for half a window after.
    assert first_judged() < verdict.step <= 2 * SETTINGS.window_steps
    assert "learning_rate" in verdict.advice
    seen = verdict.evidence
    assert seen["steps"][1] == verdict.step and seen["before_steps"][1] == verdict.step - SETTINGS.window_steps
    assert f"{seen['loss_mean']:.4f}" in verdict.message and f"{seen['before_loss_mean']:.4f}" in verdict.message
    assert f"steps {seen['before_steps'][0]}-{seen['before_steps'][1]}" in verdict.message


def test_a_loss_that_stops_falling_is_a_plateau_after_it_stops():
    monitor = HealthMonitor(SETTINGS)
    reached = feed(monitor, range(1, 1501), noisy(lambda step: healthy_loss(min(step, 500))))
    assert [v.name for v in reached] == ["plateau"]
    assert 500 < reached[0].step <= 1200  # two windows of 250 steps, then half of one


def test_a_tiny_update_ratio_is_stagnation():
    reached = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss), ratio=lambda step: 2e-6)
    assert [v.name for v in reached] == ["stagnating_updates"]
    assert reached[0].step == first_judged()  # low all along: said as soon as judging starts
    assert "1e-3" in reached[0].message and "2.0e-06" in reached[0].message
    assert reached[0].evidence["ratio_median"] == pytest.approx(2e-6)


def test_a_collapsing_update_ratio_is_stagnation_but_a_decaying_learning_rate_is_not():
    lr = lambda step: 1e-3 * (1 - step / 1200)  # noqa: E731
    falls_with_lr = feed(HealthMonitor(SETTINGS), range(1, 1001), noisy(healthy_loss),
                         ratio=lambda step: 2 * lr(step), lr=lr)
    assert falls_with_lr == []
    collapsed = feed(HealthMonitor(SETTINGS), range(1, 1001), noisy(healthy_loss),
                     ratio=lambda step: 2e-3 if step < 400 else 1e-5 * 1.5, lr=lambda step: 1e-3)
    assert [v.name for v in collapsed] == ["stagnating_updates"]
    assert 400 < collapsed[0].step <= 400 + SETTINGS.window_steps  # once most of a window is low
    assert "a hundredth of its peak" in collapsed[0].message


def test_clipping_near_the_threshold_is_no_verdict():
    """A norm hovering around grad_clip (the demo's, early on) is clipped on most steps: that is clipping doing its
    job, not an explosion."""
    around_clip = noisy(lambda step: 1.1, sd=0.2, seed=3)
    assert feed(HealthMonitor(SETTINGS), range(1, 1001), noisy(healthy_loss), norm=around_clip) == []


def test_a_norm_far_above_the_clip_is_exploding_gradients_with_the_numbers():
    reached = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss), norm=lambda step: 30.0)
    assert [v.name for v in reached] == ["exploding_gradients"]
    verdict = reached[0]
    assert verdict.step == SETTINGS.window_steps  # the first full window after the warmup: not waiting for a second
    assert verdict.evidence["norm_median"] == 30.0 and verdict.evidence["grad_clip"] == 1.0
    assert verdict.evidence["clipped_share"] == 1.0
    assert "median is 30 over steps" in verdict.message and "grad_clip 1" in verdict.message
    below = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss), norm=lambda step: 9.0)
    assert below == []  # under ten times the clip, and not growing
    settles = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss),
                   norm=lambda step: 30.0 if step <= 100 else 0.5)
    assert settles == []  # the first steps' unruly norms, not the window's level


def test_a_growing_gradient_norm_without_clipping_is_exploding_gradients():
    settings = HealthSettings(1024, 1000, 20, 0.0)
    reached = feed(HealthMonitor(settings), range(1, 1001), noisy(healthy_loss),
                   norm=lambda step: 0.5 if step < 500 else 0.5 * 1.05 ** (step - 500))
    assert [v.name for v in reached] == ["exploding_gradients"]
    assert 500 < reached[0].step < 800
    seen = reached[0].evidence
    assert seen["norm_median"] > 10 * seen["before_norm_median"] and seen["before_norm_median"] == 0.5
    assert f"steps {seen['before_steps'][0]}-{seen['before_steps'][1]}" in reached[0].message


def test_non_finite_norms_are_exploding_gradients():
    reached = feed(HealthMonitor(SETTINGS), range(1, 400), noisy(healthy_loss),
                   norm=lambda step: 0.5 if step < 100 else math.inf)
    assert [v.name for v in reached] == ["exploding_gradients"]
    assert "not finite" in reached[0].message


def test_a_verdict_already_announced_is_not_announced_again():
    monitor = HealthMonitor(SETTINGS, announced={"plateau"})
    assert feed(monitor, range(1, 1001), noisy(lambda step: 6.9)) == []


def test_the_first_steps_loss_is_checked_on_the_step():
    monitor = HealthMonitor(SETTINGS)
    assert [v.name for v in monitor.observe_step(1, 30.0, 5.0)] == ["initial_loss"]
    assert monitor.observe_step(2, 6.0, 0.5) == []


@pytest.mark.parametrize("series", ["healthy", "flat", "exploding", "stagnating"])
def test_the_verdicts_are_the_same_whatever_the_log_interval_and_a_replay_reaches_them(series: str):
    loss, norm, ratio = noisy(healthy_loss, seed=5), lambda step: 0.8, lambda step: 1e-3
    if series == "flat":
        loss = noisy(lambda step: 6.9, seed=5)
    elif series == "exploding":
        norm = lambda step: 0.8 if step < 500 else 0.8 * 1.03 ** (step - 500)  # noqa: E731
    elif series == "stagnating":
        ratio = lambda step: 2e-3 if step < 500 else 1e-6  # noqa: E731
    seen = {}
    for interval in (1, 10, 50):
        written: list = []
        live = feed(HealthMonitor(SETTINGS), range(1, 1001), loss, ratio=ratio, norm=norm, log_interval=interval,
                    written=written)
        replayed = replay(written, SETTINGS).summary()["verdicts"]
        assert [(v["name"], v["step"]) for v in replayed] == [(v.name, v.step) for v in live]
        fresh = replay([r for r in written if r["kind"] == "train"], SETTINGS).summary()["verdicts"]
        assert [(v["name"], v["step"], v["message"]) for v in fresh] == [(v.name, v.step, v.message) for v in live]
        seen[interval] = [(v.name, v.step) for v in live]
    assert [name for name, _ in seen[1]] == [name for name, _ in seen[10]] == [name for name, _ in seen[50]]
    assert (seen[1] == []) == (series == "healthy")
    if series != "stagnating":  # from every step's loss and norm: the very same steps
        assert seen[1] == seen[10] == seen[50]
    else:  # the ratio is measured at log steps only: the same verdict, within a log interval and a block
        steps = [found[0][1] for found in seen.values()]
        assert max(steps) - min(steps) <= 50 + SETTINGS.block_steps


def test_replay_reads_recorded_events_and_judges_train_records_after_a_rollback():
    written = [{"kind": "event", "event": "health", "verdict": "initial_loss", "step": 1, "message": "m",
                "advice": "a"}]
    monitor = HealthMonitor(SETTINGS)
    rng = random.Random(1)
    feed(monitor, range(1, 600), lambda step: healthy_loss(step) + rng.gauss(0, 0.05), written=written)
    written = [r for r in written if r["step"] <= 300]  # rolled back to step 300 (the resume drops the rest)
    feed(monitor, range(301, 1001), lambda step: 6.0 + rng.gauss(0, 0.05), written=written)
    replayed = replay(written, SETTINGS)
    names = [v["name"] for v in replayed.summary()["verdicts"]]
    assert names == ["initial_loss", "plateau"]
    assert replayed.summary()["verdicts"][0]["message"] == "m"  # as recorded
    assert replayed.summary()["signals"]["step"] == 1000
    assert replayed.summary()["verdicts"][1] == monitor.summary()["verdicts"][0]  # the plateau training reached


def test_a_rollback_forgets_the_steps_trained_again():
    monitor = HealthMonitor(SETTINGS)
    feed(monitor, range(1, 600), noisy(healthy_loss), norm=lambda step: 2.0)
    feed(monitor, range(301, 551), noisy(healthy_loss), norm=lambda step: 0.5)  # rolled back to step 300
    signals = monitor.summary()["signals"]
    assert signals["step"] == 550 and signals["grad_norm_level"] == 0.5 and signals["clipped_share"] == 0.0


DEMO_RECORDS = Path(__file__).parent / "golden" / "demo_train_records.jsonl"


def test_the_demos_healthy_run_reaches_no_verdict():
    """The train records (loss, grad norms, clipped share, update ratios) of runs/demo trained to its 1200 steps on
    a CPU, logged every 10 steps before runs recorded blocks, replayed from its logged steps: the run docs/health.md's
    healthy figures come from is judged healthy."""
    records = [json.loads(line) for line in DEMO_RECORDS.read_text().splitlines()]
    demo = json.loads((Path(__file__).parents[1] / "runs" / "demo" / "train.json").read_text())
    settings = HealthSettings(token_rows=1024, total_steps=demo["max_steps"], warmup_steps=demo["warmup_steps"],
                              grad_clip=demo["grad_clip"])
    monitor = replay(records, settings)
    assert monitor.summary()["verdicts"] == []
    last = monitor.summary()["signals"]
    assert last["step"] == 1200 and 1e-4 < last["update_ratio"]["decay"] < 1e-2
