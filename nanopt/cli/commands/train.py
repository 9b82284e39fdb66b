"""`nanopt train`: single process, or DDP / FSDP2 under torchrun (started for you with --nproc-per-node)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Group
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import SET_HELP, Invocation, app, console, load_run_config, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.display.health import health_table
from nanopt.cli.display.mixture import source_tables
from nanopt.cli.display.prediction import PredictingDisplay, prediction_table
from nanopt.cli.helptext import DEVICES_PANEL, epilog
from nanopt.cli.launch import STOPPED_EARLY, check_launcher_options, launch_if_asked, slurm_launcher, slurm_named
from nanopt.cli.rank_errors import ERROR_DIR_ENV, crash_of_another_rank
from nanopt.errors import ConfigError, DistributedError
from nanopt.hardware import check_price_per_hour
from nanopt.parsing import parse_overrides
from nanopt.runtime import ranks, restarts, under_torchrun
from nanopt.train.parallel.world_fit import micro_batch_for_world
from nanopt.untrusted_text import printable

ABOUT = """
--on-exit (train.json on_exit): rank 0 runs the command once through the shell when the run ends: completed,
preempted (SIGTERM / SIGINT, saved), diverged, error, interrupted (a second Ctrl-C) or crashed, in
NANOPT_EXIT_REASON, with NANOPT_EXIT_STATUS, NANOPT_RUN_DIR, NANOPT_STEP and NANOPT_TOTAL_STEPS (when known) and
NANOPT_EXIT_MESSAGE (the error's line). Its output goes to RUN/on_exit.log; it is stopped, with everything it
started, after on_exit_timeout_s (300 s). It never changes the run's exit status or files.

Health (train.json health, on by default): at each log step the run records per-block gradient norms, the
update-to-parameter norm ratio per optimizer group, the share of steps clipped and the loss's trend, and says once
each verdict: initial_loss (the first loss far from ln of the token ids' count), plateau, stagnating_updates,
exploding_gradients, with the settings that usually fix it. --on-event runs a command on each, in the background,
with NANOPT_EVENT, NANOPT_EVENT_STEP, NANOPT_EVENT_MESSAGE and NANOPT_RUN_DIR, its output in RUN/on_event.log,
stopped after on_exit_timeout_s. `nanopt eval RUN --health` shows them for any run, running or finished.
No progress for stall_timeout_s (1800 s) after the first step: every rank writes its threads' stacks to
RUN/stalls/rank-R.txt, and rank 0 says so and runs --on-event with NANOPT_EVENT=stall; the run goes on waiting.

--nnodes N: run the same command on every node, each with its own --node-rank and the same --rdzv-endpoint (the
first node's HOST:PORT). The run directory and its dataset must be on a filesystem every node sees (rank 0 writes
metrics, every rank reads and writes checkpoints).

--max-restarts N: after a rank is killed or crashes, or loses contact with one that was, torchrun stops and
restarts every rank of the node (up to N times; one process runs under torchrun for this), and they resume from
the newest checkpoint; each restart is one line on stderr and a resume event in metrics.jsonl. A mistake to fix,
a divergence or a preemption is never restarted. The --on-exit command runs once, when no restart follows.
"""

EXAMPLES = """
nanopt train runs/demo                                   # CPU or one GPU
nanopt train runs/demo --resume runs/demo/checkpoints/step-000800   # again from an earlier checkpoint
nanopt train runs/gpt2-small --nproc-per-node 8          # starts torchrun itself
torchrun --nproc_per_node 8 -m nanopt train runs/gpt2-small
nanopt train runs/gpt2-small --nproc-per-node 8 --max-restarts 3   # a rank killed: restart all, resume, go on
nanopt train runs/llama-3.2-1b --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-endpoint head:29500
nanopt train runs/demo --resume none --set max_steps=50 --set train_tokens=null
nanopt train runs/demo --resume none --set max_steps=3000   # ~1.4 passes over its data, each epoch reshuffled
nanopt train runs/gpt2-small --on-exit 'sudo shutdown -h now'   # stop paying when the run ends, however it ends
nanopt train runs/demo --resume none --set optimizer=muon   # Muon on the hidden matrices, AdamW on the rest
nanopt train runs/demo --set tensorboard=true               # also log to runs/demo/tensorboard/
nanopt train runs/demo --resume none --set seq_len=128 --set 'seq_len_stages=[{"from": 0.9, "seq_len": 256}]'
    # sequences of 128 tokens for 90% of the steps, then of 256 (train.json seq_len_stages)
nanopt train runs/demo --set recovery=false                 # stop at a divergence instead of rolling back
nanopt train runs/demo --on-exit 'curl -d "$NANOPT_EXIT_REASON" https://ntfy.sh/mytopic'   # a message when it ends
nanopt train runs/gpt2-small --on-event 'curl -d "$NANOPT_EVENT: $NANOPT_EVENT_MESSAGE" https://ntfy.sh/mytopic'
"""

# The option panels of --help, by job.
HOOKS = "Commands run on events"


@app.command("train", epilog=epilog(ABOUT, EXAMPLES))
def train_command(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with model.json and train.json."),
    resume: str = typer.Option("auto", "--resume", metavar="CHECKPOINT", help="auto (newest complete checkpoint, if "
                               "any), none (start over: the earlier checkpoints and metrics move to previous/; an "
                               "imported run starts again from the import), latest, best, or a checkpoint path."),
    allow_changed: bool = typer.Option(False, "--allow-changed/--no-allow-changed", help="Resume although the "
                                       "learning rate, budget, micro-batch or world size changed (never model or "
                                       "data)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    price_per_hour: float | None = typer.Option(None, "--price-per-hour", metavar="USD", help="USD per GPU-hour for "
                                                "the live cost, the summary and eval --compare (train.json "
                                                "price_per_hour; default: the GPU table's typical price, none on a "
                                                "CPU)."),
    no_live: bool = typer.Option(False, "--no-live/--live", help="Log lines only, no live progress bar (--live: "
                                 "the bar, the default)."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the end-of-run summary as JSON."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", metavar="N", rich_help_panel=DEVICES_PANEL,
                                       help="Processes (GPUs) on this node; > 1 starts torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", metavar="N", rich_help_panel=DEVICES_PANEL,
                               help="Nodes in a multi-node run (passed to torchrun)."),
    node_rank: int = typer.Option(0, "--node-rank", metavar="N", rich_help_panel=DEVICES_PANEL,
                                  help="This node's rank (passed to torchrun)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT",
                                             rich_help_panel=DEVICES_PANEL, help="The rendezvous: the first node's, "
                                             "the same on every node (needed with --nnodes > 1)."),
    max_restarts: int = typer.Option(0, "--max-restarts", metavar="N", rich_help_panel=DEVICES_PANEL,
                                     help="Times torchrun may restart the ranks after one is killed or crashes, each "
                                     "time resuming from the newest checkpoint (0: the job stops and says why)."),
    on_exit: str | None = typer.Option(None, "--on-exit", metavar="COMMAND", rich_help_panel=HOOKS,
                                       help="Shell command rank 0 runs once when the run ends for any reason, with "
                                       "NANOPT_EXIT_REASON set (train.json on_exit); e.g. \"sudo shutdown -h now\"."),
    on_event: str | None = typer.Option(None, "--on-event", metavar="COMMAND", rich_help_panel=HOOKS,
                                        help="Shell command rank 0 runs, in the background, on each health verdict "
                                        "and on a stall, with NANOPT_EVENT set to its name; e.g. "
                                        "'curl -d \"$NANOPT_EVENT\" https://ntfy.sh/mytopic'."),
) -> None:
    """Train a run to its token budget: resumable, DDP or FSDP2, bf16 and compile on CUDA, live metrics."""
    slurm = slurm_launcher(_layout_given(ctx))  # under srun: the job's nodes and GPUs, unless options say otherwise
    if slurm is not None:
        nproc_per_node, nnodes, node_rank, rdzv_endpoint = (1, 1, 0, None) if slurm.per_task else (
            slurm.nproc_per_node, slurm.nnodes, slurm.node_rank, slurm.endpoint)
    check_launcher_options(nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    hook = _ExitHook(run_dir, on_exit)
    with hook:  # a train.json that cannot be read still runs the --on-exit command
        check_price_per_hour(price_per_hour)
        run = load_run_config(run_dir, sets, {"price_per_hour": price_per_hour, "on_exit": on_exit})
        hook.configure(run, from_file=on_exit is None and "on_exit" not in parse_overrides(sets or []))
        if run.train.downstream_tasks:  # a misspelt task fails now, not at the first evaluation
            from nanopt.evaluate.tasks.catalog import parse_tasks

            parse_tasks(run.train.downstream_tasks, "train.json: key 'downstream_tasks'", ConfigError)
        if not under_torchrun() or slurm is not None:
            # Catch config mistakes here, as one line and exit 2, before torchrun wraps them in its own report.
            with slurm_named(slurm):
                micro_batch_for_world(run, slurm.world_size if slurm else nproc_per_node * nnodes, resume)
    # torchrun's launcher leaves here with its ranks' exit status: rank 0 among them runs the hook, never this process.
    launch_if_asked(nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts)
    from nanopt.evaluate.tasks.inloop import InLoopTasks
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    started = ctx.obj.started if isinstance(ctx.obj, Invocation) else None
    with hook:
        downstream = InLoopTasks.from_run(run.train, run.run_dir)
        summary = train(run, TrainOptions(resume=resume, allow_changed=allow_changed, started=started,
                                          downstream=downstream),
                        PredictingDisplay(run, ranks().world_size, live=not no_live,
                                          on_health=_event_hook(run, on_event)))
        if ranks().is_main:
            from nanopt.train.observe.prediction import compared

            summary["prediction"] = compared(run.run_dir)
            if as_json:
                print_json(summary)
            else:
                console().print(_summary_table(summary))
    hook.finished(summary)
    if not summary["completed"]:  # stopped by SIGTERM / SIGINT after saving: not a finished run
        raise typer.Exit(STOPPED_EARLY)


# The status `nanopt train` leaves with for each reason, as nanopt.cli.app.main and the launcher exit.
_EXIT_STATUS = {"completed": 0, "preempted": STOPPED_EARLY, "diverged": 2, "error": 2, "interrupted": 130,
                "crashed": 1}


class _ExitHook:
    """The on-exit command (train.json `on_exit`, --on-exit), run once by the process whose end is the run's end:
    rank 0, or the one that was to start torchrun when the run fails before it. `with hook:` around work whose
    failure ends the run runs it with that error, which then goes on to nanopt.cli.app.main unchanged (the same
    error line and exit status); `finished(summary)` runs it when training returned."""

    def __init__(self, run_dir: Path, command: str | None) -> None:
        from nanopt.config import TrainConfig

        self.run_dir, self.command = run_dir, command  # --on-exit's command until train.json is read
        self.timeout_s: float = TrainConfig.on_exit_timeout_s  # the default, until then
        self.total_steps: int | None = None

    def configure(self, run: Any, from_file: bool) -> None:
        """The command and its timeout as the run's config has them. One that came from train.json rather than the
        command line is said before it can run (before the first step): it is the one command from a file nanopt
        runs, and a run directory may come from someone else."""
        self.command, self.timeout_s = run.train.on_exit, run.train.on_exit_timeout_s
        self.total_steps = run.total_steps
        if self.command and from_file and _says_what_runs():
            console(stderr=True).print("on_exit (from train.json) runs through the shell when this training ends: "
                                       f'"{escape(printable(self.command))}"', soft_wrap=True)

    def __enter__(self) -> _ExitHook:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if error is not None:
            self._run(error, None)
        return False  # never swallows the error

    def finished(self, summary: dict[str, Any]) -> None:
        self._run(None, summary)

    def _run(self, error: BaseException | None, summary: dict[str, Any] | None) -> None:
        from nanopt.train.guard import exit_hook

        if not (self.command and ranks().is_main and exit_hook.ends_the_run(error)) or _restart_follows(error):
            return
        reason = exit_hook.exit_reason(error, summary is None or summary["completed"])
        message = exit_hook.error_message(error)
        crash = _crash_behind(error)
        if crash is not None:  # this rank only lost contact with the one that crashed: the run ends with its crash
            reason, message = "crashed", f"rank {crash.rank} {crash.line}"
        details = exit_hook.ExitDetails(_EXIT_STATUS[reason], summary["steps"] if summary else None,
                                        summary["total_steps"] if summary else self.total_steps, message)
        _print_hook_result(exit_hook.run_exit_hook(self.command, reason, self.run_dir, self.timeout_s, details))


def _layout_given(ctx: typer.Context) -> bool:
    """Whether the command line names the ranks' layout itself, which then wins over SLURM's."""
    names = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint")
    # By name: Typer carries its own copy of click, whose ParameterSource is not click's.
    return any(getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT" for name in names)


def _event_hook(run: Any, command: str | None) -> Any:
    """The --on-event runner the display calls on a verdict (rank 0): the command in a thread of its own, so the
    training steps go on while it runs, then one line saying what became of it. None without --on-event."""
    if not command:
        return None
    import threading

    from nanopt.train.guard.exit_hook import run_event_hook

    def run_it(event: dict[str, Any]) -> None:
        _print_hook_result(run_event_hook(command, event, run.run_dir, run.train.on_exit_timeout_s), "on-event")

    return lambda event: threading.Thread(target=run_it, args=(event,), name="nanopt-on-event").start()


def _says_what_runs() -> bool:
    """Rank 0 of a plain torchrun, or the process that starts nanopt's own torchrun (its ranks say nothing of it):
    one announcement per run, before any rank runs a step."""
    return ranks().is_main and not os.environ.get(ERROR_DIR_ENV)


def _crash_behind(error: BaseException | None) -> Any:
    """The crash of another rank that this rank's lost contact comes from (nanopt.cli.rank_errors), or None."""
    return crash_of_another_rank(ranks().rank) if isinstance(error, DistributedError) else None


def _restart_follows(error: BaseException | None) -> bool:
    """Whether torchrun restarts the ranks after this rank's failure (--max-restarts; see
    nanopt.cli.launch.worth_a_restart): then the run goes on, and the hook waits for its end. A lost contact or a
    crash is restarted; a mistake, a divergence or an interruption is this rank's verdict and ends the run."""
    from nanopt.errors import DistributedError, NanoptError

    if error is None or not restarts().left:
        return False
    return isinstance(error, DistributedError) or not isinstance(error, (NanoptError, KeyboardInterrupt))


def _print_hook_result(result: Any, what: str = "on-exit") -> None:
    prefix = "" if result.ok else "[yellow]warning:[/] "
    console(stderr=True).print(f"{prefix}{what}: {escape(result.describe())}", soft_wrap=True)


def _summary_table(s: dict[str, Any]) -> Group:
    """The run's outcome, then where its time and money went."""
    health = [health_table(s["health"], "health of this run")] if s.get("health") else []
    predicted = [prediction_table(s["prediction"])] if s.get("prediction") else []
    return Group(_outcome_table(s), *source_tables(s), *health,
                 fmt.phase_table(s["time"], f"time and cost per phase: {_sessions(s['time'])}"), *predicted)


def _sessions(t: dict[str, Any]) -> str:
    sessions = "this session" if t["sessions"] == 1 else f"all {t['sessions']} sessions of this run"
    if t.get("price_per_hour") is None:
        return sessions
    return f"{sessions}, at ${t['price_per_hour']:,.2f} per GPU-hour x {t['world_size']} GPU(s)"


def _outcome_table(s: dict[str, Any]) -> Table:
    status = "complete" if s["completed"] else f"stopped at step {s['steps']} of {s['total_steps']}"
    table = Table(title=escape(f"nanopt train: {s['run']} ({status})"), show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    mfu = fmt.percent(s["mfu"]) if s["mfu"] is not None else (s["mfu_note"] or "- (no known GPU peak)")
    rows = [("steps", f"{s['steps']:,} / {s['total_steps']:,}"), ("tokens", fmt.count(s["tokens"])),
            ("epochs (passes over the train split)", f"{s['epochs']:.2f}"),
            ("training loop time (this session)", fmt.duration(s["seconds"])),
            ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
            ("MFU", mfu), ("final train loss", _loss(s["final_train_loss"])),
            ("final val loss", _loss(s["final_val_loss"])), ("best val loss", _loss(s["best_val_loss"])),
            ("skipped non-finite steps", str(s["skipped_steps"])),
            ("latest checkpoint", s["latest_checkpoint"] or "-"), ("best checkpoint", s["best_checkpoint"] or "-")]
    if s.get("downstream"):
        rows.append((f"downstream tasks (step {s['downstream']['step']:,})", _downstream(s["downstream"])))
    for label, value in rows:
        table.add_row(label, escape(value))  # the run's and its checkpoints' paths
    return table


# Per task, the numbers the end-of-run table shows: accuracy by the harness's acc_norm where the task has it.
_HEADLINE = ("acc_norm", "acc", "perplexity")


def _downstream(flat: dict[str, Any]) -> str:
    """`hellaswag acc_norm 26.0%, lambada_openai acc 1.0% perplexity 812.3; centered mean 0.4%` from an eval
    record's task_NAME_METRIC keys (nanopt.train.downstream)."""
    tasks: dict[str, dict[str, float]] = {}
    for key, value in flat.items():
        for metric in ("acc_per_token", "acc_norm", "acc", "centered", "perplexity"):
            if key.startswith("task_") and key.endswith("_" + metric) and key != "task_centered_mean":
                tasks.setdefault(key[len("task_"):-len(metric) - 1], {})[metric] = value
                break
    parts = []
    for name, metrics in tasks.items():
        accuracy = next(m for m in _HEADLINE if m in metrics)
        text = f"{name} {accuracy} {fmt.percent(metrics[accuracy])}" if accuracy != "perplexity" else name
        parts.append(text + (f" perplexity {metrics['perplexity']:.2f}" if "perplexity" in metrics else ""))
    mean = flat.get("task_centered_mean")
    return ", ".join(parts) + ("" if mean is None else f"; centered mean {fmt.percent(mean)}")


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
