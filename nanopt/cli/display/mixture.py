"""A data mixture's figures as `nanopt train` shows them: a compact part of the live line, and a table of the
sources at the end of the run (nanopt.train.mixture_report makes the figures)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from nanopt.cli.display import format as fmt


def live_sources(record: dict[str, Any]) -> str:
    """"  src web 0.41 code 1.20": the passes over each source so far; nothing for a single dataset."""
    sources = record.get("sources")
    if not sources:
        return ""
    return "  src " + " ".join(f"{name} {figures['epochs']:.2f}" for name, figures in sources.items())


def source_tables(summary: dict[str, Any]) -> list[Table]:
    """The mixture's sources at the end of the run: weight (one column per data phase, headed by its steps), tokens
    read, epochs, latest val loss."""
    sources = summary.get("sources")
    if not sources:
        return []
    phases = summary.get("data_phases") or []
    weights = [f"weight, steps {p['first_step']:,}-{p['last_step']:,}" for p in phases] if phases else ["weight"]
    table = Table(title="data mixture: what each source gave", title_justify="left")
    for column in ("source", *weights, "tokens", "epochs", "val loss"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for name, figures in sources.items():
        loss = "-" if figures.get("val_loss") is None else f"{figures['val_loss']:.4f}"
        shares = [p["weights"].get(name, 0.0) for p in phases] if phases else [figures["weight"]]
        table.add_row(escape(name), *(f"{share:.3f}" if share else "0" for share in shares),
                      fmt.count(figures["tokens"]), f"{figures['epochs']:.2f}", loss)
    return [table]


def plan_table(plans: list[dict[str, Any]], title: str) -> Table:
    """nanopt.data.mixtures.mixture_plan's records: what the run reads from each source, and whether each holds it."""
    table = Table(title=escape(title), title_justify="left")
    for column in ("source", "weight", "run reads", "one pass needs", "train split", "epochs", ""):
        table.add_column(column, justify="left" if column in ("source", "") else "right")
    for plan in plans:
        verdict = ("too small" if plan["too_small"] else "short: repeats" if plan["short"] else
                   "not tokenized yet" if plan["split_tokens"] is None else "enough")
        epochs = "-" if plan["epochs"] is None else f"{plan['epochs']:.2f}"
        table.add_row(escape(plan["name"]), f"{plan['weight']:.3f}", fmt.count(plan["run_tokens"]),
                      fmt.count(plan["tokens_needed"]), fmt.count(plan["split_tokens"]), epochs, verdict)
    return table


def plan_warnings(plans: list[dict[str, Any]], limit: float) -> list[str]:
    """One line per source read more than `limit` times (data_epochs_warning), saying what to do."""
    return [f"source {plan['name']} would be read {plan['epochs']:.2f} times (data_epochs_warning {limit:g}): "
            f"tokenize at least {fmt.count(plan['tokens_needed'])} train tokens into {plan['path']}, or lower its "
            "weight" for plan in plans if plan["too_small"] and plan["epochs"] is not None]
