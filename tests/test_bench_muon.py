"""bench/bench_muon.py's sweep logic: a best learning rate at an edge of its sweep gets the next point past that
edge, a rerun skips the runs its results file already holds for the same settings, and the tokens to a target
loss are interpolated between evaluations. Training itself is the real `nanopt train` (not run here: minutes)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from clihelp import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_muon  # noqa: E402

SETTINGS = {"steps": 1200, "warmup_steps": 50, "eval_interval": 100, "eval_tokens": 32768, "data": "/d", "seed": 1}


def record(optimizer: str, lr: float, loss: float, settings: dict = SETTINGS) -> dict:
    return {"bench": "muon", "optimizer": optimizer, "lr": lr, "final_val_loss": loss, "tokens": 200,
            "curve": [[100, loss + 1.0], [200, loss]], "settings": settings}


def write(out: Path, records: list[dict]) -> None:
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def sweep_with_fake_training(monkeypatch: pytest.MonkeyPatch, out: Path, losses: dict[tuple[str, float], float],
                             max_extra: int = 2) -> list:
    """Runs bench_muon.sweep with every run that is not yet recorded answered from `losses`; the runs it trains."""
    trained = []

    def fake_run(out: Path, optimizer: str, lr: float, settings: dict, adamw_lr: float) -> dict:
        trained.append((optimizer, lr))
        with (out / "results.jsonl").open("a") as results:
            results.write(json.dumps(record(optimizer, lr, losses[optimizer, lr], settings)) + "\n")
        return {**record(optimizer, lr, losses[optimizer, lr], settings), "wall_s": 1.0}

    monkeypatch.setattr(bench_muon, "run_one", fake_run)
    start = {"adamw": [1.5e-3, 3e-3, 6e-3], "muon": [0.01, 0.02, 0.04]}
    bench_muon.sweep(out, start, SETTINGS, argparse.Namespace(adamw_lr=3e-3, max_extra=max_extra))
    return trained


def test_a_best_at_an_edge_gets_the_next_point_past_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    losses = {("adamw", 1.5e-3): 3.0, ("adamw", 3e-3): 3.1, ("adamw", 6e-3): 3.2, ("adamw", 7.5e-4): 3.05,
              ("muon", 0.01): 3.0, ("muon", 0.02): 2.9, ("muon", 0.04): 2.95}
    trained = sweep_with_fake_training(monkeypatch, tmp_path, losses)
    assert trained == [("adamw", 3e-3), ("muon", 0.02),  # the defaults first
                       ("adamw", 1.5e-3), ("adamw", 6e-3), ("adamw", 7.5e-4),  # AdamW's best was at the low edge
                       ("muon", 0.01), ("muon", 0.04)]  # Muon's was inside
    report = bench_muon.summary(tmp_path, {"adamw": [1.5e-3, 3e-3, 6e-3], "muon": [0.01, 0.02, 0.04]}, SETTINGS,
                                argparse.Namespace())
    assert report["adamw"]["best_lr"] == 1.5e-3 and report["adamw"]["best_inside_sweep"]
    assert report["complete"]


def test_extension_stops_at_max_extra_and_leaves_it_incomplete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    losses = {("adamw", 1.5e-3): 3.2, ("adamw", 3e-3): 3.1, ("adamw", 6e-3): 3.0, ("adamw", 1.2e-2): 2.9,
              ("muon", 0.01): 3.0, ("muon", 0.02): 2.9, ("muon", 0.04): 2.95}
    trained = sweep_with_fake_training(monkeypatch, tmp_path, losses, max_extra=1)
    assert [run for run in trained if run[0] == "adamw"][3:] == [("adamw", 1.2e-2)]
    report = bench_muon.summary(tmp_path, {"adamw": [1.5e-3, 3e-3, 6e-3], "muon": [0.01, 0.02, 0.04]}, SETTINGS,
                                argparse.Namespace())
    assert report["adamw"]["best_lr"] == 1.2e-2 and not report["adamw"]["best_inside_sweep"]
    assert not report["complete"]


def test_a_rerun_skips_recorded_runs_of_the_same_settings_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = {**SETTINGS, "steps": 48}
    write(tmp_path, [record("adamw", 3e-3, 3.1), record("muon", 0.02, 2.9), record("muon", 0.01, 2.8, other)])
    losses = {("adamw", 1.5e-3): 3.2, ("adamw", 6e-3): 3.3, ("muon", 0.01): 3.0, ("muon", 0.04): 2.95}
    trained = sweep_with_fake_training(monkeypatch, tmp_path, losses)
    assert trained == [("adamw", 1.5e-3), ("adamw", 6e-3), ("muon", 0.01), ("muon", 0.04)]


def test_tokens_to_reach_interpolates_between_the_evaluations_around_the_crossing() -> None:
    curve = [(100, 5.0), (200, 4.0), (300, 3.0)]
    assert bench_muon.tokens_to_reach(curve, 3.5) == pytest.approx(250.0)
    assert bench_muon.tokens_to_reach(curve, 5.5) == 100.0
    assert bench_muon.tokens_to_reach(curve, 2.5) is None
