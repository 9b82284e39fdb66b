"""`nanopt train`: single process, or DDP / FSDP2 under torchrun (started for you with --nproc-per-node)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli import format as fmt
from nanopt.cli.app import SET_HELP, app, console, load_run_config, print_json

# Exit status of a run stopped by SIGTERM / SIGINT before its end, its state saved (EX_TEMPFAIL: try again). Not 0,
# so a job scheduler or retry loop does not take a preempted run for a finished one.
STOPPED_EARLY = 75

EPILOG = """
Examples:

  nanopt train runs/demo                                   # CPU or one GPU

  nanopt train runs/gpt2-small --nproc-per-node 8          # starts torchrun itself

  torchrun --nproc_per_node 8 -m nanopt train runs/gpt2-small

  nanopt train runs/llama-1b --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint head:29500

  nanopt train runs/demo --resume none --set max_steps=50 --set train_tokens=null

  nanopt train runs/demo --resume runs/demo/checkpoints/step-000100
"""


@app.command("train", epilog=EPILOG)
def train_command(
    run_dir: Path = typer.Argument(..., help="Run directory with model.json and train.json."),
    resume: str = typer.Option("auto", "--resume", help="auto (newest complete checkpoint, if any), none, "
                                                        "latest, best, or a checkpoint path."),
    allow_changed: bool = typer.Option(False, "--allow-changed", help="Resume although the learning rate, "
                                       "budget, micro-batch or world size changed (never model or data)."),
    sets: list[str] | None = typer.Option(None, "--set", help=SET_HELP),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Processes (GPUs) on this node; > 1 "
                                                                   "starts torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes in a multi-node run (passed to torchrun)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank (passed to torchrun)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="host:port of the rendezvous "
                                                                              "(passed to torchrun)."),
    no_live: bool = typer.Option(False, "--no-live", help="Log lines only, no live progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the end-of-run summary as JSON."),
) -> None:
    """Train a run to its token budget: resumable, DDP or FSDP2, bf16 and compile on CUDA, live metrics."""
    run = load_run_config(run_dir, sets)
    if (nproc_per_node > 1 or nnodes > 1) and "WORLD_SIZE" not in os.environ:
        # Catch config mistakes here, as one line and exit 2, before torchrun wraps them in its own report.
        run.grad_accum_steps(nproc_per_node * nnodes)
        run_torchrun(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    from nanopt.train import TrainOptions, train

    summary = train(run, TrainOptions(resume=resume, allow_changed=allow_changed, live=not no_live))
    if os.environ.get("RANK", "0") == "0" and as_json:
        print_json(summary)
    elif os.environ.get("RANK", "0") == "0":
        console().print(_summary_table(summary))
    if not summary["completed"]:  # stopped by SIGTERM / SIGINT after saving: not a finished run
        raise typer.Exit(STOPPED_EARLY)


def run_torchrun(nproc: int, nnodes: int, node_rank: int, endpoint: str | None) -> NoReturn:
    """Run torchrun in this process (so signals reach it directly) on the same command, and exit with what the
    ranks meant: 0 done, 2 a user error (rank 0 printed it as one line), STOPPED_EARLY after a SIGTERM / SIGINT,
    1 with one line naming the rank that failed; never torchrun's own traceback and failure table."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    if nnodes > 1 or endpoint:
        args += [f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint or 'localhost:29500'}"]
    else:
        args.append("--standalone")
    _quiet_torchrun_logs()
    try:
        torchrun_main(args + ["-m", "nanopt", *strip_launcher_options(sys.argv[1:])])
    except SignalException as exc:  # torchrun passed the signal on to every rank and waited for them
        console(stderr=True).print(f"stopped by {signal.Signals(exc.sigval).name}: run the same command again to "
                                   "continue from the newest checkpoint", soft_wrap=True, markup=False)
        sys.exit(STOPPED_EARLY)
    except ChildFailedError as exc:
        sys.exit(_failure_status(exc.failures))
    sys.exit(0)


def _quiet_torchrun_logs() -> None:
    """torchrun logs every failed or signalled worker and a banner; the ranks and `_failure_status` say it in
    one line. Set LOGLEVEL to see torchrun's own logs."""
    if "LOGLEVEL" in os.environ:
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _failure_status(failures: dict[int, Any]) -> int:
    # Once one rank fails torchrun stops the others with SIGTERM: those are not news.
    codes = {f.exitcode for f in failures.values()} - {-signal.SIGTERM}
    if codes and codes <= {2, STOPPED_EARLY}:  # rank 0 already said why in one line
        return max(codes)
    # A rank killed by a signal, or one that crashed, is why the others lost contact (their status 2 says so).
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode in (2, -signal.SIGTERM),
                                                             item[1].exitcode >= 0, item[0]))
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with {failure.exitcode}"
    oom = " (SIGKILL is often the out-of-memory killer: see `dmesg`)" if failure.exitcode == -signal.SIGKILL else ""
    _error(f"rank {rank} (pid {failure.pid}) {how}, so torchrun stopped the others",
           f"complete checkpoints are kept: fix the cause{oom} and run the same command to resume")
    return 1


def _error(message: str, hint: str) -> None:
    console(stderr=True).print(f"[bold red]error:[/] {escape(message)}. Hint: {escape(hint)}", soft_wrap=True)


def strip_launcher_options(argv: list[str]) -> list[str]:
    launcher = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in launcher:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _summary_table(s: dict[str, Any]) -> Table:
    status = "complete" if s["completed"] else f"stopped at step {s['steps']} of {s['total_steps']}"
    table = Table(title=f"nanopt train: {s['run']} ({status})", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    mfu = fmt.percent(s["mfu"]) if s["mfu"] is not None else "- (no known GPU peak)"
    rows = [("steps", f"{s['steps']:,} / {s['total_steps']:,}"), ("tokens", fmt.count(s["tokens"])),
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
