"""`nanopt health`: a run's health from its metrics.jsonl, without reading a checkpoint (the same report as
`nanopt eval RUN --health`, which stays for those who know it there)."""

from __future__ import annotations

from pathlib import Path

import typer

from nanopt.cli.app import app
from nanopt.cli.display.health import show_health
from nanopt.cli.helptext import epilog

ABOUT = """
Replays the run's metrics.jsonl (finished, or still training: a torn last line is skipped) through the monitor
training uses and prints its verdicts, each with the numbers it saw, and the latest signals; draws RUN/health.png
(loss, gradient norms, update ratios, the share of steps clipped, against steps). No checkpoint, no GPU: it can run
beside training. docs/health.md says what each verdict means and its thresholds.
"""

EXAMPLES = """
nanopt health runs/demo                 # verdicts and signals; runs/demo/health.png
nanopt health runs/demo runs/gpt2-small --json   # several runs, as JSON
"""


@app.command("health", epilog=epilog(ABOUT, EXAMPLES))
def health_command(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN", help="One run directory, or several."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the report as JSON."),
) -> None:
    """A run's health: verdicts, the numbers behind them and the latest signals, from its metrics.jsonl."""
    show_health(run_dirs, as_json)
