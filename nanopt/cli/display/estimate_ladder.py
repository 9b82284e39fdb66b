"""`nanopt estimate`'s memory-ladder table and its --compare-gpus table (nanopt.plan.estimate.ladder)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import console
from nanopt.cli.display import format as fmt
from nanopt.plan.estimate.ladder import set_options


def checkpointing_words(setting: bool | int | str) -> str:
    """train.json's activation_checkpointing as words: off, on (every block), every k blocks, selective."""
    if isinstance(setting, bool) or setting == 1:
        return "on" if setting else "off"
    return f"every {setting} blocks" if isinstance(setting, int) else setting


def print_ladder(ladder: dict[str, Any]) -> None:
    """Every rung at the run's GPU count, fastest first; the recommended one in bold."""
    out = console()
    gpus = f"{ladder['gpus']} GPU{'s' if ladder['gpus'] != 1 else ''}"
    table = Table(title=f"memory ladder on {gpus} of {fmt.size(ladder['gpu_memory_bytes'])} ({ladder['precision']}): "
                        "fastest first", title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, padding=(0, 1, 0, 0), caption=escape(ladder["assumptions"]))
    for header in ("rung", "per GPU", "host per GPU", "micro-batch", "slowdown", "fits"):
        # The rung's name wraps where the width is short (a terminal of 80 columns): a cut number reads as another one.
        table.add_column(header, justify="left" if header == "rung" else "right", no_wrap=header != "rung")
    recommended = ladder["recommended"]
    for row in ladder["rows"]:
        table.add_row(escape(row["name"]), fmt.size(row["memory_bytes"]),
                      fmt.size(row["host_bytes"]) if row["host_bytes"] else "-", str(row["micro_batch_size"]),
                      f"{row['slowdown']:.2f}x", "yes" if row["fits"] else "[red]no[/]",
                      style="bold" if row is recommended else None)
    out.print(table)
    if recommended is None:
        out.print("[bold red]ladder:[/] no rung fits at micro-batch 1 on this many GPUs")
    else:
        out.print(f"[bold green]recommended:[/] {escape(recommended['name'])} (micro-batch "
                  f"{recommended['micro_batch_size']}): {escape(set_options(recommended))}", soft_wrap=True)


def print_compared(compared: dict[str, Any]) -> None:
    out = console()
    table = Table(title=f"the run on {compared['num_gpus']} of each GPU (assumed MFU {fmt.percent(compared['mfu'])}), "
                        "cheapest per token first", title_justify="left", caption_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), caption=escape(compared["assumptions"]))
    for header in ("GPU", "precision", "rung", "time", "cost", "$ / M tokens"):
        table.add_column(header, justify="left" if header in ("GPU", "rung") else "right", no_wrap=True)
    for row in compared["rows"]:
        if not row["fits"]:
            table.add_row(row["gpu"], row["precision"], "[red]nothing fits[/]", "-", "-", "-")
            continue
        table.add_row(row["gpu"], row["precision"], escape(row["rung"]["name"]), fmt.duration(row["train_seconds"]),
                      fmt.money(row["cost_usd"]), fmt.money(row["usd_per_million_tokens"]))
    out.print(table)
