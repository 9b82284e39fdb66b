"""`nanopt eval --tasks` and `--harness`: the options into TaskOptions and HarnessOptions, and the downstream
results as one rich table, a column per run (several runs side by side, as eval compares their losses) and,
with --harness, a column per run for lm-evaluation-harness's own numbers beside nanopt's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import console
from nanopt.errors import ConfigError


def task_options(tasks: str | None, limit: int | None, task_data: Path | None, harness: str | None = None) -> Any:
    """TaskOptions for --tasks (None without it); --limit or --task-data without --tasks or --harness is a
    mistake, and so is a task whose file --task-data lacks (found now, not after the model is loaded)."""
    if tasks is None:
        if harness is None and (limit is not None or task_data is not None):
            raise ConfigError("--limit and --task-data apply to downstream tasks, and no --tasks was given",
                              "add --tasks hellaswag,arc_easy,... (or all)")
        return None
    from nanopt.evaluate.tasks.catalog import parse_tasks
    from nanopt.evaluate.tasks.downstream import TaskOptions
    from nanopt.evaluate.tasks.sources import check_task_files

    names = parse_tasks(tasks)
    check_task_files(names, task_data)  # every task's file, before a checkpoint is read
    return TaskOptions(names=names, limit=limit, task_data=task_data)


def harness_options(harness: str | None, limit: int | None, task_data: Path | None, nproc_per_node: int) -> Any:
    """HarnessOptions for --harness (None without it). A missing `harness` extra, a task the harness would not
    find in --task-data, or several processes: one line now, before any checkpoint is read."""
    if harness is None:
        return None
    from nanopt.evaluate.tasks.catalog import parse_tasks
    from nanopt.evaluate.tasks.harness import HarnessOptions, check_task_data, require_harness

    opts = HarnessOptions(names=parse_tasks(harness, "--harness"), limit=limit, task_data=task_data,
                          export=_export)
    if nproc_per_node > 1:
        raise ConfigError("--harness runs lm-evaluation-harness in one process",
                          "drop --nproc-per-node, or score with --tasks alone on several processes")
    require_harness()
    check_task_data(opts)
    return opts


def _export(trained: Any, out_dir: Path) -> Path:
    """The checkpoint as a transformers directory (nanopt export's own code), for the harness's `hf` model."""
    from nanopt.export.hf import export_hf
    from nanopt.train.checkpoint import load_model_state

    return export_hf(trained.run.model, load_model_state(trained.checkpoint), trained.tokenizer_path, out_dir,
                     eos_id=trained.eos_id)


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
    if "centered" in task:  # nanopt's own; the harness reports no centered accuracy
        rows.append((f"centered ({task['centered']['of']})", _cell(task["centered"])))
    return rows


def _columns(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], Any]]:
    """(header, tasks, centered mean) per column: each run's nanopt scores, then the harness's (--harness)."""
    columns = []
    for r in results:
        where = f"{r['run']} @ {r['step']:,}"
        if r.get("tasks"):
            columns.append((where, r["tasks"], r.get("centered_mean")))
        if r.get("harness"):
            columns.append((f"{where} (harness)", r["harness"], None))
    return columns


def render_tasks(results: list[dict[str, Any]]) -> None:
    """One table: task, metric, then a column per run, and with --harness a column of the harness's own numbers
    beside it (percent ± standard error; n examples each)."""
    columns = _columns(results)
    if not columns:
        return
    table = Table(title="downstream tasks, zero-shot (percent ± standard error)", title_justify="left")
    table.add_column("task", style="bold")
    table.add_column("metric")
    for header, _, _ in columns:
        table.add_column(escape(header), justify="right")
    names = list(dict.fromkeys(name for _, tasks, _ in columns for name in tasks))
    for name in names:
        scored = [tasks[name] for _, tasks, _ in columns if name in tasks]
        metrics = list(dict.fromkeys(metric for task in scored for metric, _ in _rows(task)))
        for i, metric in enumerate(metrics):
            cells = [dict(_rows(tasks[name])).get(metric, "-") if name in tasks else "-" for _, tasks, _ in columns]
            n = scored[0].get("n")
            label = "" if i else name + ("" if n is None else f" (n={n:,})")
            table.add_row(escape(label), metric, *cells)
    if any(mean is not None for _, _, mean in columns):
        table.add_row("mean", "centered", *("-" if mean is None else f"{100 * mean:.1f}" for _, _, mean in columns),
                      end_section=True)
    console().print(table)
    for r in results:
        times = [f"{name} {t['seconds']:.1f} s" for name, t in (r.get("tasks") or {}).items()]
        if r.get("harness_seconds") is not None:
            times.append(f"lm-evaluation-harness {r['harness_seconds']:.1f} s (export included)")
        if times:
            console().print(escape(f"{r['run']}: {', '.join(times)}"))
