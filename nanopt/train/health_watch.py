"""The training loop's side of run health: measure at log steps, judge, record and announce each verdict once.

The probe (nanopt.train.health_probe) runs on every rank, in the step, at log steps; the monitor
(nanopt.train.health) on every rank too (pure arithmetic on numbers every rank has), but only rank 0 writes the
`health` events of metrics.jsonl and hears of them (the observer's `health`, through which the CLI prints the
verdict and runs the --on-event command). No collective depends on a verdict.
"""

from __future__ import annotations

from typing import Any

from nanopt.train.health import HealthMonitor, HealthSettings, Verdict
from nanopt.train.health_probe import HealthProbe
from nanopt.train.metrics import read_metrics
from nanopt.train.session import Session


def start_health(s: Session) -> None:
    """Give the session its probe and monitor (train.json `health`), after the resume: a verdict the run already
    announced (its `health` event in metrics.jsonl, on rank 0) is not announced again."""
    if not s.run.train.health:
        return
    s.health_probe = HealthProbe(s.prepared.raw, s.optimizer, s.rt)
    s.health = HealthMonitor(HealthSettings.from_run(s.run, token_rows=s.dataset.id_limit))  # as the model
    if s.rt.is_main:
        s.health.recall(read_metrics(s.run.run_dir))


def after_step(s: Session, loss: float, grad_norm: float) -> None:
    """Every step (not rolled back): count clipping; at step 1, the initial loss check."""
    if s.health is not None:
        _announce(s, s.health.observe_step(s.state.step, loss, grad_norm))


def on_log(s: Session, record: dict[str, Any]) -> None:
    """A log step: add the step's health fields to its train record, and announce what they newly show."""
    if s.health is None:
        return
    record.update(s.health_signals)
    s.health_signals = {}
    record["clipped_fraction"] = s.health.clipped_fraction()
    _announce(s, s.health.observe(record))


def summary(s: Session) -> dict[str, Any] | None:
    """The end-of-run summary's `health` section, or None when health is off."""
    return None if s.health is None else s.health.summary()


def _announce(s: Session, verdicts: list[Verdict]) -> None:
    for verdict in verdicts:
        fields = {"verdict": verdict.name, "message": verdict.message, "advice": verdict.advice}
        s.metrics.write("event", step=verdict.step, event="health", **fields)
        s.observer.health({"step": verdict.step, **fields})
