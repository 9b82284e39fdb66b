"""`nanopt preflight`: a few dozen real steps of a run, checked and projected to its end in time and money."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import SET_HELP, Invocation, app, console, load_run_config, print_json
from nanopt.cli.commands.find_batch import seconds
from nanopt.cli.commands.plan import correct_after_preflight, render_correction
from nanopt.cli.display import format as fmt
from nanopt.cli.display.mixture import plan_table, plan_warnings
from nanopt.cli.helptext import DEVICES_PANEL, epilog
from nanopt.cli.launch import CHECKS_FAILED, check_launcher_options, launch_if_asked
from nanopt.runtime import ranks, under_torchrun
from nanopt.untrusted_text import shell_word

ABOUT = """
Nothing of the run is touched (no checkpoint, no metrics.jsonl, no lock): the checkpoint is timed in a temporary
directory beside the run directory, removed afterwards. It writes RUN/preflight.json (and with --find-batch the
search's find_batch.json), which `nanopt estimate RUN` then uses for its time and cost. On a run `nanopt plan`
wrote that has not started, the plan is corrected to its budget at the measured rate: train.json's training
tokens, learning rate, warmup and intervals, and plan.json's "corrected", with a table of what changed (the
model and batch, which the preflight measured, stay). Exit status 0 when every
check passed, 3 when one failed (each is listed), 2 for a mistake to fix; so
`nanopt preflight runs/demo && nanopt train runs/demo` trains only a run that passed.
"""

EXAMPLES = """
nanopt preflight runs/demo                                  # CPU: 3 + 10 s of steps, 2 evaluations, 1 checkpoint
nanopt preflight runs/gpt2-small --price-per-hour 2.49      # your provider's price per GPU-hour
nanopt preflight runs/gpt2-small --find-batch               # the micro-batch find-batch picks, then measure it
nanopt preflight runs/demo --find-batch --max-memory 2GiB   # CPU: bound find-batch's trials
nanopt preflight runs/llama-3.2-1b --nproc-per-node 8       # on the ranks that will train
nanopt preflight runs/demo --steps 60 --json
"""

# The option panels of --help, by job.
MICRO_BATCH = "Micro-batch search"


@app.command("preflight", epilog=epilog(ABOUT, EXAMPLES))
def preflight_command(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with model.json and train.json."),
    steps: int | None = typer.Option(None, "--steps", metavar="N", help="Optimizer steps measured, after --warmup "
                                     "(default: 30, or more to fill 10 s, up to the run's own steps or 1,000)."),
    warmup: int = typer.Option(3, "--warmup", metavar="N", help="Steps run first and not measured: the optimizer "
                               "state and torch.compile's first step (counted as setup when compiled)."),
    price_per_hour: float | None = typer.Option(None, "--price-per-hour", metavar="USD", help="USD per GPU-hour for "
                                                "the cost (default: train.json price_per_hour, else the GPU table's "
                                                "typical price; none on a CPU)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    find_batch: bool = typer.Option(False, "--find-batch/--no-find-batch", rich_help_panel=MICRO_BATCH,
                                    help="Measure the micro-batch `nanopt find-batch` picks (the fastest that fits) "
                                    "instead of train.json's; its search also writes find_batch.json."),
    max_memory: str | None = typer.Option(None, "--max-memory", metavar="SIZE", rich_help_panel=MICRO_BATCH,
                                          help="With --find-batch on a CPU, where it is required: the peak resident "
                                          "memory a trial may reach, e.g. 4GiB."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", metavar="N", rich_help_panel=DEVICES_PANEL,
                                       help="Ranks on this node, as training will use; > 1 starts torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", metavar="N", rich_help_panel=DEVICES_PANEL,
                               help="Nodes, as training will use (passed to torchrun)."),
    node_rank: int = typer.Option(0, "--node-rank", metavar="N", rich_help_panel=DEVICES_PANEL,
                                  help="This node's rank (passed to torchrun)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", metavar="HOST:PORT",
                                             rich_help_panel=DEVICES_PANEL, help="The rendezvous: the first node's, "
                                             "the same on every node (needed with --nnodes > 1)."),
    correct: bool = typer.Option(True, "--correct-plan/--no-correct-plan", help="On a run `nanopt plan` wrote "
                                 "that has not started: correct its steps, learning rate and intervals to the "
                                 "budget at the measured rate (train.json and plan.json)."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print preflight.json's contents instead of tables."),
) -> None:
    """Before paying for a run: real training steps on this machine, checked (the loss falls, memory is flat, the
    data loader keeps up) and projected to the whole run's time per phase and cost, next to what `nanopt estimate`
    assumed."""
    from nanopt.hardware import parse_size
    from nanopt.plan.preflight import PreflightOptions, preflight

    check_launcher_options(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    opts = PreflightOptions(steps=steps, warmup=warmup, find_batch=find_batch, price_per_hour=price_per_hour,
                            max_memory=parse_size(max_memory, "--max-memory") if max_memory is not None else None,
                            started=ctx.obj.started if isinstance(ctx.obj, Invocation) else None)
    opts.validate()
    run = load_run_config(run_dir, sets)
    if not under_torchrun() and not find_batch:
        # A batch that does not divide over the ranks is one line here, before torchrun wraps it in its report.
        run.grad_accum_steps(nproc_per_node * nnodes)
    launch_if_asked(nproc_per_node, nnodes, node_rank, rdzv_endpoint)
    main = ranks().is_main
    with _Progress(main) as progress:
        report = preflight(run, opts, on_progress=progress.stage, on_trial=progress.trial)
    if main:
        # Only what the preflight measured is corrected: with --set it measured another run than train.json's. A
        # failed check (listed below) does not stop it: the rate measured is still the rate this run trains at.
        correction = correct_after_preflight(run, nproc_per_node * nnodes) if correct and not sets else None
        if as_json:
            print_json({**report, "plan_correction": correction} if correction else report)
        else:
            render(report)
            if correction:
                render_correction(correction, Path(report["run"]))
        _say_failures(report)
    if not report["ok"]:
        raise typer.Exit(CHECKS_FAILED)


class _Progress:
    """A progress bar over the stages and steps on stderr, rank 0 only, drawn only on a terminal; find-batch's
    trials one line each."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.out = console(stderr=True)
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            # Off when stderr is no terminal: a transient bar still leaves an empty line in a log or a pipe.
            self.bar = Progress(TextColumn("[bold]preflight[/] {task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(), console=self.out, transient=True,
                                disable=not self.out.is_terminal)
            self.bar.start()
            self.task = self.bar.add_task("", total=None)
        return self

    def stage(self, name: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=name, completed=done, total=total if total > 1 else None)

    def trial(self, trial: Any) -> None:
        if self.enabled:
            speed = f", {trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else ""
            self.out.print(f"find-batch: micro-batch {trial.micro_batch_size}: {trial.reason}, peak "
                           f"{fmt.size(trial.peak_memory_bytes)}{speed}", markup=False)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


def _say_failures(r: dict[str, Any]) -> None:
    from nanopt.plan.preflight_report import CHECK_LABELS

    out = console(stderr=True)
    for name in r["failed"]:
        out.print(f"[bold red]preflight check failed:[/] {escape(CHECK_LABELS[name])}: "
                  f"{escape(r['checks'][name]['detail'])}", soft_wrap=True)


def render(r: dict[str, Any]) -> None:
    out = console()
    threads = r["device"].get("cpu_threads")
    if threads:  # what measured the step on a CPU: training chooses the same way at its start
        count = threads["threads"]
        out.print(escape(f"CPU: {count} thread{'s' if count != 1 else ''}"
                         f"{' per rank' if threads.get('ranks', 1) > 1 else ''} ({threads['reason']})"))
    out.print(_comparison_table(r))
    out.print(_measured_table(r))
    out.print(_projection_table(r))
    out.print(_checks_table(r))
    if r.get("sources"):
        out.print(plan_table(r["sources"], "data mixture: tokens each source gives the run"))
        for warning in plan_warnings(r["sources"], r["data_epochs_warning"]):
            out.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    advice = r["micro_batch"]["advice"]
    if advice:
        out.print(f"[bold]find-batch picked micro-batch {r['micro_batch']['size']}[/] (train.json has "
                  f"{r['micro_batch']['train_json']}): {escape(advice)} in train.json (or `nanopt find-batch "
                  f"{escape(shell_word(r['run']))} --write`) to train as measured", soft_wrap=True)
    out.print(f"saved {escape(str(Path(r['run']) / 'preflight.json'))}: `nanopt estimate "
              f"{escape(shell_word(r['run']))}` uses its measured throughput", soft_wrap=True)


def _title(r: dict[str, Any]) -> str:
    d, mb = r["device"], r["micro_batch"]
    ranks_text = f"{d['world_size']} ranks, " if d["world_size"] > 1 else ""
    return (f"nanopt preflight: {r['run']} on {d['name']} ({ranks_text}{r['precision']}, compile "
            f"{'on' if r['compile'] else 'off'}; micro-batch {mb['size']} from {mb['source']}, accumulation "
            f"{r['grad_accum']}; {r['steps']['warmup']} + {r['steps']['measured']} steps{_stage(r)})")


def _stage(r: dict[str, Any]) -> str:
    """' at the longest seq_len stage, 4096' when the steps were measured there (a run with stages)."""
    measured_at = r["steps"].get("seq_len")
    if not measured_at or measured_at == r["fingerprint"]["seq_len"]:
        return ""
    return f" at the longest seq_len stage, {measured_at:,}"


def _comparison_table(r: dict[str, Any]) -> Table:
    """Measured against what `nanopt estimate` assumes for the same run on the same device."""
    e, p = r["estimate"], r["projection"]
    table = Table(title=escape(_title(r)), title_justify="left")
    for name in ("", "measured", "estimate", "ratio"):
        table.add_column(name, justify="left" if not name else "right")
    assumed = "note" not in e
    ratio = e.get("ratio") or {}
    table.add_row("throughput", f"{r['tokens_per_s']:,.0f} tokens/s",
                  f"{e['tokens_per_s']:,.0f} tokens/s" if assumed else "-", _ratio(ratio.get("tokens_per_s")))
    table.add_row("MFU", _mfu(r), fmt.percent(e["mfu"]) if assumed else "-", "")
    table.add_row("training steps", fmt.duration(p["seconds"]["train"]),
                  fmt.duration(e["train_seconds"]) if assumed else "-", _ratio(ratio.get("train_seconds")))
    table.caption = escape(f"estimate: `nanopt estimate --gpu {shell_word(e['gpu'])}` at its default MFU" if assumed
                           else e["note"]) + escape(f". MFU against {r['peak_source']}")
    return table


def _checkpoint_text(r: dict[str, Any]) -> str:
    writing = r.get("checkpoint_writer_cpu_s") or 0.0
    if not writing:
        return seconds(r["checkpoint_s"])
    return (f"{seconds(r['checkpoint_s'])} ({seconds(r['checkpoint_blocked_s'])} blocking the step, "
            f"{seconds(writing)} writing in the background on the cores the steps use)")


def _measured_table(r: dict[str, Any]) -> Table:
    table = Table(title="measured", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    eval_text = (f"{seconds(r['eval_s'])} (the first: {seconds(r['eval_first_s'])})" if r["eval_s"] is not None
                 else "- (eval_interval 0)")
    rows = [("step time", seconds(r["step_time_s"])),
            ("setup (process start to the first step)", fmt.duration(r["setup_s"])),
            ("one evaluation", eval_text), ("one checkpoint", _checkpoint_text(r)),
            ("peak memory", f"{fmt.size(r['memory']['peak_bytes'])} ({r['memory']['measure']})"),
            ("data-loader wait", f"{fmt.percent(r['loader_wait_share'])} of the step time")]
    for label, value in rows:
        table.add_row(label, escape(value))
    return table


def _projection_table(r: dict[str, Any]) -> Table:
    p = r["projection"]
    title = (f"projection: the whole run ({p['steps']:,} steps, {p['evaluations']} evaluation(s), "
             f"{p['checkpoints']} checkpoint(s)) on {p['devices']} device(s)")
    table = Table(title=escape(title), title_justify="left")
    for name in ("phase", "time", "share", "cost"):
        table.add_column(name, justify="left" if name == "phase" else "right")
    cost = p["cost_usd"] or {}
    for phase, value in p["seconds"].items():
        table.add_row(phase, fmt.duration(value), fmt.percent(p["shares"][phase]), fmt.money(cost.get(phase)))
    table.add_row("[bold]total[/]", f"[bold]{fmt.duration(p['total_s'])}[/]", "100.0%",
                  f"[bold]{fmt.money(p['total_cost_usd'])}[/]")
    price = (f"at ${p['price_per_hour']:,.2f} per device-hour ({p['price_source']})" if p["price_per_hour"] is not None
             else f"no price: {p['price_source']}")
    table.caption = escape(f"{price}; other time (log lines, the loss chart, waiting) is not projected")
    return table


def _checks_table(r: dict[str, Any]) -> Table:
    from nanopt.plan.preflight_report import CHECK_LABELS

    table = Table(title="checks", title_justify="left", show_header=False)
    table.add_column("")
    table.add_column("")
    table.add_column("", overflow="fold")
    for name, check in r["checks"].items():
        mark = "[green]ok[/]" if check["ok"] else "[bold red]FAILED[/]"
        table.add_row(mark, escape(CHECK_LABELS[name]), escape(check["detail"]))
    return table


def _mfu(r: dict[str, Any]) -> str:
    if r["mfu"] is not None:
        return fmt.percent(r["mfu"])
    return r["mfu_note"] or "-"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"
