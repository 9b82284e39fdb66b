"""Rendering run health (nanopt.train.health.verdicts): the table at the end of `nanopt train`, and `nanopt health` (or
`nanopt eval --health`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from nanopt.rundir import RunDir
from nanopt.train.health.verdicts import BLOCKS_PER_WINDOW, MIN_BLOCKS


def health_table(health: dict[str, Any], title: str) -> Table:
    """The verdicts (or that there are none), then the latest signals."""
    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    for v in health["verdicts"] or [{"name": "verdicts", "step": None, "message": "none", "advice": ""}]:
        where = f"step {v['step']}: " if v["step"] is not None else ""
        advice = f"; {v['advice']}" if v["advice"] else ""
        table.add_row(escape(v["name"]), escape(f"{where}{v['message']}{advice}"),
                      style="yellow" if v["step"] is not None else None)
    for label, value in signal_rows(health["signals"]):
        table.add_row(label, escape(value))
    return table


def signal_rows(signals: dict[str, Any]) -> list[tuple[str, str]]:
    """The latest signals as (label, text) rows; nothing before the first logged step. `nanopt train`'s table and
    `nanopt health` both render the monitor's summary through here, so they say the same figures in the same
    words."""
    if not signals:
        return []
    trend = signals.get("loss_trend")
    ratios = {k: v for k, v in (signals.get("update_ratio") or {}).items() if v is not None}
    clipped = signals.get("clipped_share")
    # A window reaches back window_steps from the latest step: a run stopped before it is that long has only
    # its steps so far in it.
    window = f"last {min(signals['window_steps'], signals['step']):,} steps"
    return [
        ("at step", f"{signals['step']:,}"),
        (f"loss trend ({window})", _trend(trend, signals["window_steps"])),
        ("gradient norm (before clipping)", _number(signals.get("grad_norm"), ".3f")),
        (f"gradient norm median ({window})", _number(signals.get("grad_norm_level"), ".3f")),
        (f"steps clipped ({window})", "-" if clipped is None else f"{clipped:.0%}"),
        ("update / parameter norm per step", ", ".join(f"{k} {v:.1e}" for k, v in ratios.items()) or "-"),
    ]


def _trend(trend: float | None, window_steps: int) -> str:
    """The fitted change of the loss, or what it waits for: MIN_BLOCKS blocks of the window with a finite loss."""
    if trend is not None:
        return f"{trend:+.2%}"
    return f"- (fitted once {MIN_BLOCKS} blocks of {window_steps // BLOCKS_PER_WINDOW:,} steps hold a finite loss)"


def _number(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, spec)


def show_health(run_dirs: list[Path], as_json: bool) -> None:
    """`nanopt health RUN` (and `nanopt eval RUN --health`): each run's verdicts and latest signals from its
    metrics.jsonl, and its chart."""
    from nanopt.cli.app import console, print_json
    from nanopt.config import load_run
    from nanopt.errors import ConfigError
    from nanopt.train.health.replay import health_report

    reports = []
    for run_dir in run_dirs:
        load_run(run_dir)  # a file, a missing or unreadable directory, a name too long: one line each
        if not RunDir(run_dir).metrics.is_file():
            raise ConfigError(f"{run_dir}: no metrics.jsonl: the run has not logged a step yet",
                              "start it with `nanopt train RUN`, or name a run directory that has trained")
        reports.append(health_report(run_dir))
    if as_json:
        print_json(reports[0] if len(reports) == 1 else {"runs": reports})
        return
    for report in reports:
        console().print(health_table(report, f"run health: {report['run']}"))
        if report["chart"]:
            console().print(escape(f"chart: {report['chart']} (loss, gradient norms, update ratios and the share "
                                   "of steps clipped, against steps)"))
