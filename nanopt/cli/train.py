"""`nanopt train`: single process, or DDP / FSDP2 under torchrun (started for you with --nproc-per-node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nanopt.cli import format as fmt
from nanopt.cli.app import SET_HELP, app, console, load_run_config, print_json
from nanopt.cli.launch import STOPPED_EARLY, check_launcher_options, launch_if_asked
from nanopt.cli.train_display import Display
from nanopt.runtime import ranks, under_torchrun

EPILOG = """
Examples:

  nanopt train runs/demo                                   # CPU or one GPU

  nanopt train runs/demo --resume runs/demo/checkpoints/step-000800   # again from an earlier checkpoint

  nanopt train runs/gpt2-small --nproc-per-node 8          # starts torchrun itself

  torchrun --nproc_per_node 8 -m nanopt train runs/gpt2-small

  nanopt train runs/llama-3.2-1b --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint head:29500

  nanopt train runs/demo --resume none --set max_steps=50 --set train_tokens=null

  nanopt train runs/demo --resume none --set max_steps=3000   # ~1.4 passes over its data, each epoch reshuffled
"""


@app.command("train", epilog=EPILOG)
def train_command(
    run_dir: Path = typer.Argument(..., help="Run directory with model.json and train.json."),
    resume: str = typer.Option("auto", "--resume", help="auto (newest complete checkpoint, if any), none, "
                                                        "latest, best, or a checkpoint path."),
    allow_changed: bool = typer.Option(False, "--allow-changed/--no-allow-changed", help="Resume although the "
                                       "learning rate, budget, micro-batch or world size changed (never model or "
                                       "data)."),
    sets: list[str] | None = typer.Option(None, "--set", help=SET_HELP),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Processes (GPUs) on this node; > 1 "
                                                                   "starts torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes in a multi-node run (passed to torchrun)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank (passed to torchrun)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="host:port of the rendezvous "
                                                                              "(passed to torchrun)."),
    no_live: bool = typer.Option(False, "--no-live/--live", help="Log lines only, no live progress bar (--live: "
                                 "the bar, the default)."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the end-of-run summary as JSON."),
) -> None:
    """Train a run to its token budget: resumable, DDP or FSDP2, bf16 and compile on CUDA, live metrics."""
    check_launcher_options(nproc_per_node, nnodes, node_rank)
    run = load_run_config(run_dir, sets)
    if not under_torchrun():
        # Catch config mistakes here, as one line and exit 2, before torchrun wraps them in its own report.
        run.grad_accum_steps(nproc_per_node * nnodes)
    launch_if_asked(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    summary = train(run, TrainOptions(resume=resume, allow_changed=allow_changed), Display(live=not no_live))
    if ranks().is_main:
        if as_json:
            print_json(summary)
        else:
            console().print(_summary_table(summary))
    if not summary["completed"]:  # stopped by SIGTERM / SIGINT after saving: not a finished run
        raise typer.Exit(STOPPED_EARLY)


def _summary_table(s: dict[str, Any]) -> Table:
    status = "complete" if s["completed"] else f"stopped at step {s['steps']} of {s['total_steps']}"
    table = Table(title=f"nanopt train: {s['run']} ({status})", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    mfu = fmt.percent(s["mfu"]) if s["mfu"] is not None else (s["mfu_note"] or "- (no known GPU peak)")
    rows = [("steps", f"{s['steps']:,} / {s['total_steps']:,}"), ("tokens", fmt.count(s["tokens"])),
            ("epochs (passes over the train split)", f"{s['epochs']:.2f}"),
            ("time (this session)", fmt.duration(s["seconds"])), ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
            ("MFU", mfu), ("final train loss", _loss(s["final_train_loss"])),
            ("final val loss", _loss(s["final_val_loss"])), ("best val loss", _loss(s["best_val_loss"])),
            ("skipped non-finite steps", str(s["skipped_steps"])),
            ("latest checkpoint", s["latest_checkpoint"] or "-"), ("best checkpoint", s["best_checkpoint"] or "-")]
    for label, value in rows:
        table.add_row(label, value)
    return table


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
