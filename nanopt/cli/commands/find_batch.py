"""`nanopt find-batch`: the largest and the fastest micro-batch that fit, from real training steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import SET_HELP, app, console, load_run_config, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.display.estimate_ladder import checkpointing_words
from nanopt.cli.helptext import DEVICES_PANEL, epilog
from nanopt.cli.launch import launch_if_asked
from nanopt.plan.find_batch.search import DEFAULT_MAX_TRIALS
from nanopt.runtime import ranks

EXAMPLES = """
nanopt find-batch runs/gpt2-small                           # this GPU, keeping 5% of its memory free
nanopt find-batch runs/gpt2-small --gpu-memory 40GiB        # what fits on a 40 GB card, asked on an 80 GB one
nanopt find-batch runs/llama-3.2-1b --nproc-per-node 8      # DDP / FSDP ranks agreeing on one size
nanopt find-batch runs/demo --max-memory 2GiB --max 64      # CPU: bound each trial's peak resident memory
nanopt find-batch runs/gpt2-small --write                   # then set train.json's micro_batch_size
nanopt find-batch runs/gpt2-small --max-trials 6            # a quicker answer: the largest that fit in 6 trials
nanopt find-batch runs/gpt2-small --set activation_checkpointing=true --json
"""

# The option panels of --help, by job.
SEARCH, MEMORY = "Search", "Memory limit"


@app.command("find-batch", epilog=epilog("", EXAMPLES))
def find_batch_command(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with model.json and train.json."),
    write: bool = typer.Option(False, "--write/--no-write", help="Set train.json's micro_batch_size to the result "
                               "(see --pick); other keys are kept as they are."),
    pick: str = typer.Option("best", "--pick", metavar="best|max", help="What --write writes: best (the fastest "
                             "size that fits) or max (the largest that fits); either with an exact gradient "
                             "accumulation for the configured global batch."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    start: int | None = typer.Option(None, "--start", metavar="N", rich_help_panel=SEARCH, help="First micro-batch "
                                     "to try; the search doubles from it. Default: the memory model's prediction for "
                                     "this device, in steps of 25% at first."),
    maximum: int = typer.Option(1024, "--max", metavar="N", rich_help_panel=SEARCH, help="Largest micro-batch to "
                                "try. Only sizes that divide the global batch exactly are tried."),
    steps: int = typer.Option(3, "--steps", metavar="N", rich_help_panel=SEARCH, help="Optimizer steps per trial "
                              "(>= 3: the optimizer state appears after the first; the rest are timed)."),
    max_trials: int = typer.Option(DEFAULT_MAX_TRIALS, "--max-trials", metavar="N", rich_help_panel=SEARCH,
                                   help="Stop after this many trials with the largest size that fit so far "
                                   "(search_complete false in --json)."),
    timeout: float = typer.Option(1800.0, "--timeout", metavar="SECONDS", rich_help_panel=SEARCH,
                                  help="Seconds one trial may take before it counts as failed."),
    isolation: str = typer.Option("auto", "--isolation", metavar="auto|process|in-process", rich_help_panel=SEARCH,
                                  help="Where a one-process search runs its trials: auto (this process on a GPU "
                                  "without compile, an OOM caught and its memory freed; else a fresh process per "
                                  "trial), process, or in-process."),
    margin: float = typer.Option(0.05, "--margin", metavar="FRACTION", rich_help_panel=MEMORY, help="Keep this "
                                 "fraction of the memory limit free: a size fits only if its peak <= (1 - margin) x "
                                 "limit."),
    gpu_memory: str | None = typer.Option(None, "--gpu-memory", metavar="SIZE", rich_help_panel=MEMORY,
                                          help="Cap the GPU at this much memory (e.g. 40GiB) to ask what fits on a "
                                          "smaller card."),
    max_memory: str | None = typer.Option(None, "--max-memory", metavar="SIZE", rich_help_panel=MEMORY,
                                          help="CPU only, and required there (nothing runs out of memory on a CPU): "
                                          "the peak resident memory a trial process may reach, Python and torch "
                                          "included, e.g. 4GiB."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", metavar="N", rich_help_panel=DEVICES_PANEL,
                                       help="Ranks on this node; > 1 starts torchrun and the ranks agree on every "
                                       "trial."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print one JSON object instead of tables."),
) -> None:
    """Find the largest and the fastest micro-batch that fit, with real forward, backward and optimizer steps
    at exactly the run's settings, starting from the memory model's prediction; its error reported."""
    from nanopt.errors import ConfigError
    from nanopt.hardware import parse_size
    from nanopt.plan.find_batch.finder import find_batch, write_micro_batch
    from nanopt.plan.find_batch.search import FindBatchOptions

    launch_if_asked(nproc_per_node)
    if pick not in ("best", "max"):
        raise ConfigError(f"--pick: unknown value '{pick}'", "use --pick best or --pick max")
    run = load_run_config(run_dir, sets)
    opts = FindBatchOptions(start=start, maximum=maximum, steps=steps, margin=margin, trial_timeout_s=timeout,
                            gpu_memory=parse_size(gpu_memory) if gpu_memory is not None else None,
                            max_memory=parse_size(max_memory, "--max-memory") if max_memory is not None else None,
                            max_trials=max_trials, isolation=isolation)
    main = ranks().is_main
    progress = _Progress(main)
    report = find_batch(run, opts, on_start=progress.start, on_trial=progress.done)
    progress.stop()
    if not main:
        return
    if not as_json:
        render(report)
    if write:
        report["written"] = write_micro_batch(run_dir, report, pick)
        if not as_json:
            w = report["written"]
            console().print(f"[bold]{escape(w['path'])}[/]: micro_batch_size {w['old']} -> {w['new']} ({pick})")
    if as_json:
        print_json(report)


class _Progress:
    """A spinner while a trial runs and one line per finished trial, on stderr (stdout stays JSON-clean)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.out = console(stderr=True)
        self.status: Any = None

    def start(self, size: int) -> None:
        if self.enabled:
            self.stop()
            self.status = self.out.status(f"trial: micro-batch {size} ...")
            self.status.start()

    def done(self, trial: Any) -> None:
        if not self.enabled:
            return
        self.stop()
        speed = f", {trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else ""
        above = "> " if trial.peak_is_lower_bound else ""
        self.out.print(f"micro-batch {trial.micro_batch_size}: {trial.reason}, peak "
                       f"{above}{fmt.size(trial.peak_memory_bytes)}{speed}", markup=False)

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def render(r: dict[str, Any]) -> None:
    out = console()
    out.print(_trials_table(r))
    out.print(_result_table(r))


def _trials_table(r: dict[str, Any]) -> Table:
    where = f"{r['world_size']} rank(s), " if r["world_size"] > 1 else ""
    title = (f"nanopt find-batch: {r['run']} on {r['device_name']} ({where}{r['precision']}, compile "
             f"{'on' if r['compiled'] else 'off'}, activation checkpointing "
             f"{checkpointing_words(r['activation_checkpointing'])}, {r['parallelism']}, seq_len {r['seq_len']})")
    table = Table(title=escape(title), title_justify="left")
    for name in ("micro-batch", "result", "peak", "predicted", "tokens/s", "MFU", "step", "accum"):
        table.add_column(name, justify="left" if name == "result" else "right")
    for t in r["trials"]:
        style = "green" if t["fits"] else "red"
        accum = str(t["grad_accum"]) if t["grad_accum"] is not None else "inexact"
        peak = ("> " if t["peak_is_lower_bound"] else "") + fmt.size(t["peak_memory_bytes"])
        table.add_row(str(t["micro_batch_size"]), f"[{style}]{escape(t['reason'])}[/]", peak,
                      fmt.size(t["predicted_peak_bytes"]), _rate(t["tokens_per_s"]),
                      fmt.percent(t["mfu"]) if t["mfu"] is not None else (t["mfu_note"] or "-"),
                      seconds(t["step_time_s"]), accum)
    table.caption = (f"accum: gradient accumulation for the configured global batch of "
                     f"{r['global_batch_tokens']:,} tokens. tokens/s and step: the fastest timed trial step "
                     "(accumulation 1, optimizer step included). predicted: nanopt.model.memory.estimate_memory. "
                     + _limit_text(r))
    return table


def _result_table(r: dict[str, Any]) -> Table:
    c = r["calibration"]
    table = Table(show_header=False, title="result", title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    capped = (" (the largest size up to --max that divides the global batch: every usable size fit)"
              if r["max_micro_batch_capped"] else "")
    rows = [
        ("largest that fits", f"{r['max_micro_batch']}{capped}{_accum(r['grad_accum_at_max'])}"
                              if r["max_micro_batch"] else "none: see the reasons above"),
        ("largest with exact accumulation", _exact(r)),
        ("fastest (best)", f"{r['best_micro_batch']}{_accum(r['grad_accum_at_best'])}" if r["best_micro_batch"]
                           else "-"),
        ("configured", f"{r['configured']['micro_batch_size']}{_accum(r['configured']['grad_accum'])}"),
        ("search", _search_text(r)),
        ("memory model: largest", _model_largest(r)),
        ("memory model: peak", f"{fmt.size(c['predicted_peak_bytes'])} vs measured "
                               f"{fmt.size(c['measured_peak_bytes'])} at micro-batch {_value(c.get('at_micro_batch'))} "
                               f"(error {_error(c['peak_error'])})"),
        ("memory model: per sequence", f"{fmt.size(c.get('predicted_bytes_per_sequence'))} vs measured "
                                       f"{fmt.size(c.get('measured_bytes_per_sequence'))}"),
        ("MFU peak", r["peak_source"] or "-"),
        ("saved", r.get("saved", "-")),
    ]
    for label, value in rows:
        table.add_row(label, escape(value))
    table.caption = escape(c.get("note", ""))
    return table


def _model_largest(r: dict[str, Any]) -> str:
    """The memory model's largest micro-batch, one statement: as calibrated after the trials, and the estimate the
    search started from only where that differs (made before a trial had measured what it needed: on the CPU this
    process's memory stands in for a trial process's baseline)."""
    c = r["calibration"]
    largest, first = c["predicted_max_micro_batch"], r.get("predicted_micro_batch")
    text = (f"{_value(largest)}, of the usable sizes {_value(c.get('predicted_usable_micro_batch'))} (error "
            f"{_error(c['max_micro_batch_error'])})")
    if first is None or first == largest or largest is None:
        return text
    measured = "the device" if r["device"] == "cuda" else "a process's own memory"
    return f"{text}; {first} before the first trial measured {measured} (the search's start)"


def _search_text(r: dict[str, Any]) -> str:
    """Where the search started and why (the memory model's numbers are in their own row), and how long it took."""
    if r["search_start_source"] == "--start":
        source = "--start given"
    else:
        source = "from the memory model's estimate" if r.get("predicted_micro_batch") is not None else "no prediction"
    start = f"started at {r['search_start']} ({source})"
    end = "" if r["search_complete"] else f"; stopped by --max-trials {r['max_trials']} before closing in"
    where = {"process": "a process per trial", "in-process": "in this process", "ranks": "in the ranks' processes"}
    return (f"{start}, {len(r['search_order'])} trial(s) {where[r['isolation']]} in {seconds(r.get('seconds'))}"
            f"{end}")


def _limit_text(r: dict[str, Any]) -> str:
    lim = r["limit"]
    if lim["bytes"] is None:
        return ""
    kind = "GPU memory" if lim["kind"] == "gpu" else "CPU bound on peak resident memory"
    if lim["kind"] == "gpu" and lim["gpu_memory_cap"]:
        kind = "GPU memory capped by --gpu-memory"
    return (f"Fits: peak <= {fmt.size(lim['usable_bytes'])} = (1 - {lim['margin']:g}) x "
            f"{fmt.size(lim['bytes'])} ({kind}).")


def _exact(r: dict[str, Any]) -> str:
    size = r["max_exact_micro_batch"]
    if size is None:
        return "none fits"
    accum = next(t["grad_accum"] for t in r["trials"] if t["micro_batch_size"] == size)
    return f"{size}{_accum(accum)}"


def _accum(accum: int | None) -> str:
    return f", accumulation {accum}" if accum else ", accumulation inexact"


def seconds(x: float | None) -> str:
    """Seconds for a table: whole milliseconds below one second, as step times are compared."""
    if x is None:
        return "-"
    return f"{1000 * x:.0f} ms" if x < 1 else fmt.duration(x)


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _value(x: Any) -> str:
    return "-" if x is None else str(x)


def _error(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"
