"""`nanopt eval --tasks`: the options into TaskOptions, and the downstream results as one rich table, a column
per run (several runs side by side, as eval compares their losses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import console
from nanopt.errors import ConfigError


def task_options(tasks: str | None, limit: int | None, task_data: Path | None) -> Any:
    """TaskOptions for --tasks (None without it); --limit or --task-data without --tasks is a mistake."""
    if tasks is None:
        if limit is not None or task_data is not None:
            raise ConfigError("--limit and --task-data apply to downstream tasks, and no --tasks was given",
                              "add --tasks hellaswag,arc_easy,... (or all)")
        return None
    from nanopt.evaluate.tasks.catalog import parse_tasks
    from nanopt.evaluate.tasks.downstream import TaskOptions

    return TaskOptions(names=parse_tasks(tasks), limit=limit, task_data=task_data)


def _cell(metric: dict[str, Any] | None, percent: bool = True) -> str:
    if metric is None:
        return "-"
    value, err = metric["value"], metric.get("stderr")
    if not percent:
        return f"{value:.2f}"
    return f"{100 * value:.1f}" + (f" ± {100 * err:.1f}" if err is not None else "")


def _rows(task: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("acc", _cell(task["acc"]))]
    if "acc_norm" in task:
        rows.append(("acc_norm", _cell(task["acc_norm"])))
    if "acc_per_token" in task:
        rows.append(("acc_per_token", _cell(task["acc_per_token"])))
    if "perplexity" in task:
        rows.append(("perplexity", f"{task['perplexity']:.2f}"))
    rows.append((f"centered ({task['centered']['of']})", _cell(task["centered"])))
    return rows


def render_tasks(results: list[dict[str, Any]]) -> None:
    """One table: task, metric, then a column per run (percent ± standard error; n examples each)."""
    scored = [r for r in results if r.get("tasks")]
    if not scored:
        return
    table = Table(title="downstream tasks, zero-shot (percent ± standard error)", title_justify="left")
    table.add_column("task", style="bold")
    table.add_column("metric")
    for r in scored:
        table.add_column(escape(f"{r['run']} @ {r['step']:,}"), justify="right")
    names = list(dict.fromkeys(name for r in scored for name in r["tasks"]))
    for name in names:
        first = next(r["tasks"][name] for r in scored if name in r["tasks"])
        for i, (metric, _) in enumerate(_rows(first)):
            cells = []
            for r in scored:
                task = r["tasks"].get(name)
                cells.append(dict(_rows(task)).get(metric, "-") if task else "-")
            label = f"{name} (n={first['n']:,})" if i == 0 else ""
            table.add_row(escape(label), metric, *cells)
    table.add_row("mean", "centered", *(f"{100 * r['centered_mean']:.1f}" for r in scored), end_section=True)
    console().print(table)
    for r in scored:
        times = ", ".join(f"{name} {t['seconds']:.1f} s" for name, t in r["tasks"].items())
        console().print(escape(f"{r['run']}: {times}"))
