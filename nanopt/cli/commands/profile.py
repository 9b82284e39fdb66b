"""`nanopt profile`: where the training step's time goes, as a trace and a summary table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import SET_HELP, app, console, load_run_config, print_json
from nanopt.cli.commands.find_batch import seconds
from nanopt.cli.display import format as fmt
from nanopt.cli.helptext import DEVICES_PANEL, epilog
from nanopt.cli.launch import launch_if_asked
from nanopt.runtime import ranks

ABOUT = """
Open runs/NAME/profile/trace.json in https://ui.perfetto.dev or chrome://tracing; runs/NAME/profile/tensorboard/
holds the same trace for TensorBoard's PyTorch profiler plugin (tensorboard --logdir runs/NAME/profile/tensorboard,
with the torch-tb-profiler package installed).
"""

EXAMPLES = """
nanopt profile runs/demo                                   # CPU: 1 + 2 + 3 steps, trace in runs/demo/profile/
nanopt profile runs/gpt2-small --steps 5 --record-shapes
nanopt profile runs/llama-3.2-1b --nproc-per-node 8        # every rank traced, rank 0 summarizes
nanopt profile runs/gpt2-small --set compile=false --json
"""

# The option panels of --help, by job.
STEPS, TRACE = "Steps profiled", "What the trace records"


@app.command("profile", epilog=epilog(ABOUT, EXAMPLES))
def profile_command(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with model.json and train.json."),
    out: Path | None = typer.Option(None, "--out", "-o", metavar="DIR",
                                    help="Directory for the traces and summary.json (default: RUN/profile)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    steps: int = typer.Option(3, "--steps", metavar="N", rich_help_panel=STEPS,
                              help="Steps recorded and summarized (the profiler's 'active')."),
    wait: int = typer.Option(1, "--wait", metavar="N", rich_help_panel=STEPS,
                             help="Steps run first, unprofiled (optimizer state, compilation)."),
    warmup: int = typer.Option(2, "--warmup", metavar="N", rich_help_panel=STEPS,
                               help="Steps profiled then discarded (profiler start-up)."),
    record_shapes: bool = typer.Option(False, "--record-shapes/--no-record-shapes", rich_help_panel=TRACE,
                                       help="Record operator input shapes (a larger trace, more overhead)."),
    profile_memory: bool = typer.Option(False, "--profile-memory/--no-profile-memory", rich_help_panel=TRACE,
                                        help="Record allocations in the trace (a larger trace, slower to write and "
                                        "summarize)."),
    tensorboard: bool = typer.Option(True, "--tensorboard/--no-tensorboard", rich_help_panel=TRACE, help="Also "
                                     "write the trace into DIR/tensorboard/ for TensorBoard's profiler plugin."),
    top: int = typer.Option(15, "--top", metavar="N", rich_help_panel=TRACE, help="Operators / kernels to list."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", metavar="N", rich_help_panel=DEVICES_PANEL,
                                       help="Ranks on this node; > 1 starts torchrun."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the summary as JSON instead of tables."),
) -> None:
    """Profile the real training step: a Chrome / Perfetto trace, and a summary of busy vs idle time, the top
    operations by category, host overhead, data-loader wait, peak memory, tokens/s, MFU and compile graph breaks."""
    from nanopt.plan.profile import ProfileOptions, profile_run

    launch_if_asked(nproc_per_node)
    run = load_run_config(run_dir, sets)
    opts = ProfileOptions(wait=wait, warmup=warmup, active=steps, record_shapes=record_shapes,
                          profile_memory=profile_memory, top=top, out_dir=out, tensorboard=tensorboard)
    main = ranks().is_main
    with _progress(main) as on_step:
        summary = profile_run(run, opts, on_step=on_step)
    if not main:
        return
    if as_json:
        print_json(summary)
    else:
        render(summary)


class _progress:
    """A progress bar over the profiled steps on stderr, rank 0 only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        out = console(stderr=True)
        # Off when stderr is no terminal: a transient bar still leaves an empty line in a log or a pipe.
        self.bar = Progress(TextColumn("[bold]profile"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=out, transient=True, disable=not out.is_terminal)
        self.bar.start()
        self.task = self.bar.add_task("", total=None)
        return self.advance

    def advance(self, done: int, total: int) -> None:
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


def render(s: dict[str, Any]) -> None:
    out = console()
    out.print(_overview(s))
    out.print(_categories(s))
    for note in s.get("notes") or ():
        out.print(f"[yellow]note:[/] {escape(note)}")
    out.print(_top(s))


def _overview(s: dict[str, Any]) -> Table:
    where = f", {s['world_size']} ranks ({s['parallelism']})" if s["world_size"] > 1 else ""
    title = (f"nanopt profile: {s['run']} on {s['device']} ({s['precision']}{where}; micro-batch "
             f"{s['micro_batch_size']} x {s['seq_len']} x accumulation {s['grad_accum']}; "
             f"{s['schedule']['active']} profiled steps)")
    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    on_gpu = s["device"] == "cuda"
    idle_note = "" if on_gpu else ": Python between operators, dispatch, the profiler"
    rows = [
        ("step time", seconds(s["step_time_s"])),
        ("GPU busy" if on_gpu else "CPU in operators (busy)",
         f"{seconds(s['busy_s'])} ({fmt.percent(s['busy_share'])}): {s['busy_measure']}"),
        ("GPU idle" if on_gpu else "CPU outside operators (idle)",
         f"{seconds(s['idle_s'])} ({fmt.percent(s['idle_share'])}){idle_note}"),
    ]
    if on_gpu:
        host_note = "; host-bound: the GPU waits for the CPU" if s["host_bound"] else ""
        rows.append(("host time in operators + launches",
                     f"{seconds(s['cpu_overhead_s'])} ({fmt.percent(s['cpu_overhead_share'])}){host_note}"))
        rows.append(("host waiting for the GPU", f"{seconds(s['cpu_wait_s'])} (synchronize calls and copies; "
                     "not overhead)"))
    rows += [
        ("data-loader wait", f"{seconds(s['data_wait_s'])} ({fmt.percent(s['data_wait_share'])})"),
        ("peak memory", f"{fmt.size(s['peak_memory_bytes'])} ({s['peak_memory_measure']})"),
        ("throughput (profiled)", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("MFU (profiled)", fmt.percent(s["mfu"]) if s["mfu"] is not None
         else (s["mfu_note"] or f"- ({s['peak_source']})")),
        ("torch.compile", _compile_text(s["compile"])),
        ("trace", s["trace"]),
    ]
    for label, value in rows:
        table.add_row(label, escape(value))
    return table


def _compile_text(c: dict[str, Any]) -> str:
    if not c["enabled"]:
        return "compile off"
    text = f"{c['graphs']} graph(s), {c['graph_breaks']} graph break(s)"
    for reason in c["break_reasons"][:5]:
        text += f"\n  {reason['count']} x {reason['reason'][:140]}"
    return text


def _categories(s: dict[str, Any]) -> Table:
    table = Table(title="time by category (self time per step)", title_justify="left")
    table.add_column("category")
    table.add_column("per step", justify="right")
    table.add_column("share", justify="right")
    for c in s["categories"]:
        if c["seconds_per_step"] > 0:
            table.add_row(c["category"], seconds(c["seconds_per_step"]), fmt.percent(c["share"]))
    return table


def _top(s: dict[str, Any]) -> Table:
    what = "kernels" if s["device"] == "cuda" else "operators"
    table = Table(title=f"top {len(s['top_ops'])} {what} by self time", title_justify="left")
    table.add_column("name", overflow="fold", max_width=90)
    table.add_column("category")
    table.add_column("per step", justify="right")
    table.add_column("share", justify="right")
    table.add_column("calls / step", justify="right")
    launched = any(op.get("launched_by") for op in s["top_ops"])
    if launched:
        table.add_column("launched by", overflow="fold", max_width=40)
    for op in s["top_ops"]:
        row = [escape(op["name"]), op["category"], seconds(op["seconds_per_step"]), fmt.percent(op["share"]),
               f"{op['calls_per_step']:g}"]
        table.add_row(*row, *([escape(op.get("launched_by") or "-")] if launched else []))
    return table
