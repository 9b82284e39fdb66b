"""The training loop's side of run health: feed every step's loss and gradient norm, measure at log steps, judge,
record and announce each verdict once.

The probe (nanopt.train.health.probe) runs on every rank, in the step, at log steps; the monitor
(nanopt.train.health.verdicts) on every rank too (pure arithmetic on numbers every rank has), but only rank 0 writes the
`health` events of metrics.jsonl and hears of them (the observer's `health`, through which the CLI prints the
verdict and runs the --on-event command). No collective depends on a verdict.
"""

from __future__ import annotations

from typing import Any

from nanopt.train.health.probe import HealthProbe
from nanopt.train.health.verdicts import HealthMonitor, HealthSettings, Verdict, replay
from nanopt.train.observe.metrics import iter_metrics
from nanopt.train.session import Session


def start_health(s: Session) -> None:
    """Give the session its probe and monitor (train.json `health`), after the resume. On rank 0 the monitor
    replays metrics.jsonl as the resume left it (up to the checkpoint), in bounded memory: its windows go on where
    the run stopped, as if never interrupted, and a verdict the run already announced (its `health` event) is not
    announced again."""
    if not s.run.train.health:
        return
    s.health_probe = HealthProbe(s.prepared.raw, s.optimizer, s.rt)
    settings = HealthSettings.from_run(s.run, token_rows=s.dataset.id_limit)  # as the model
    s.health = replay(iter_metrics(s.run.run_dir), settings) if s.rt.is_main else HealthMonitor(settings)
    s.health.forget_unrecorded()


def after_step(s: Session, loss: float, grad_norm: float) -> None:
    """Every step (not rolled back): its loss and norm into the open block; at step 1, the initial loss check; at a
    block's end, the judgements."""
    if s.health is not None:
        _announce(s, s.health.observe_step(s.state.step, loss, grad_norm))


def on_log(s: Session, record: dict[str, Any]) -> None:
    """A log step: add the step's health fields to its train record (the probe's, the blocks ended since the last
    record, the loss trend)."""
    if s.health is None:
        return
    record.update(s.health_signals)
    s.health_signals = {}
    record["health_blocks"] = s.health.take_pending()
    s.health.observe(record)


def summary(s: Session) -> dict[str, Any] | None:
    """The end-of-run summary's `health` section, or None when health is off."""
    return None if s.health is None else s.health.summary()


def _announce(s: Session, verdicts: list[Verdict]) -> None:
    for verdict in verdicts:
        fields = {"verdict": verdict.name, "message": verdict.message, "advice": verdict.advice,
                  "evidence": verdict.evidence}
        s.metrics.write("event", step=verdict.step, event="health", **fields)
        s.observer.health({"step": verdict.step, **fields})
