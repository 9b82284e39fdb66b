"""`nanopt eval`: test loss, perplexity, bits per byte and samples for one run, or a comparison of several."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from nanopt.cli.app import app, console, print_json
from nanopt.cli.commands.eval_tasks import harness_options, render_tasks, task_options
from nanopt.cli.display import format as fmt
from nanopt.cli.display.prediction import prediction_table
from nanopt.cli.helptext import DEVICES_PANEL, epilog
from nanopt.cli.launch import launch_if_asked
from nanopt.evaluate.settings_diff import differences, shown
from nanopt.hardware import check_price_per_hour
from nanopt.runtime import ranks

ABOUT = """
The test split is never read by training (train) or its in-loop evaluation (val). By default its first 1,048,576
tokens are scored (all of it if smaller; --tokens changes that), in the run's seq_len windows from the start of the
split, the last one partial: the same tokens, so the same loss, on any number of ranks and any micro-batch size.
--tokens all scores every token of the split but the first (nothing comes before it). The output says how many
tokens were scored, of how many in the split.
Bits per byte = loss / ln 2 / (bytes per token of the test split): it compares runs with different tokenizers.

Results go to checkpoints/step-N/eval.json and runs/NAME/eval.json. With several runs, an eval.json made for the
same checkpoint and settings is reused (--fresh recomputes); each run is otherwise evaluated in turn. A table shows
the model.json and train.json settings that differ between the runs, as each checkpoint was trained, and one PNG
overlays the runs' train and validation loss against tokens (--chart; default: compare.png beside the first run,
runs/compare.png for runs/a runs/b). A file that is not a chart nanopt drew is never replaced.

--tasks scores each task's split as lm-evaluation-harness 0.4.x does (same datasets, prompts and metrics; acc,
acc_norm per character, plus acc_per_token as llm.c and nanochat count it), from the hub, or with --task-data DIR
from DIR/TASK.jsonl in the hub dataset's schema. Results go to eval.json's "tasks"; with --no-loss, no eval.json.
--harness exports the checkpoint to a temporary directory and runs lm-evaluation-harness (lm_eval.simple_evaluate,
its hf model, fp32) on the same tasks, --limit and --task-data; its numbers go to eval.json's "harness" and into
the same table, a column beside nanopt's (pip install "nanopt[harness]").

--watch scores each checkpoint of a run that is training, in step order, as it lands, on --device (another GPU, or
cpu), looking every --poll seconds; it ends when the run is complete, or on Ctrl-C (exit 130). It takes no lock and
writes nothing into checkpoints/: it holds the checkpoint it scores (a file in RUN/holds/) so retention keeps it
until it is done, and appends each result to RUN/eval_history.jsonl (also the latest to RUN/eval.json), which the
comparison and its chart read. Restarted, it skips what that history already holds.
"""

EXAMPLES = """
nanopt eval runs/demo
nanopt eval runs/demo --checkpoint best --prompt 'import os' --prompt 'Once upon a time' --seed 1
nanopt tokenize HuggingFaceFW/fineweb --config sample-10BT --tokenizer gpt2 --max-tokens 10M --out data/fineweb-gpt2
nanopt eval runs/gpt2-small --data data/fineweb-gpt2 --tokens all --no-samples --json   # same tokenizer
nanopt eval runs/gpt2-small --no-loss --prompt 'Once upon a time'   # samples only: no dataset needed
nanopt eval runs/gpt2-small runs/gpt2-medium runs/smollm-360m --price-per-hour 2.99   # best test loss first
nanopt eval runs/gpt2-small runs/gpt2-medium --chart gpt2-sizes.png   # their loss curves on one chart
nanopt eval runs/llama-3.2-1b --nproc-per-node 8             # every rank evaluates a part
nanopt eval runs/gpt2-small --tasks hellaswag,arc_easy --limit 500   # downstream tasks, zero-shot
nanopt eval runs/gpt2-small --tasks hellaswag --harness hellaswag --limit 500   # beside lm-evaluation-harness's
nanopt eval runs/demo --health      # verdicts and signals from metrics.jsonl, running or finished; health.png
nanopt eval runs/gpt2-small --watch --device cuda:7 --tasks hellaswag --limit 500   # each checkpoint as it lands
"""

TOKENS_HELP = ("Test tokens to evaluate, over all ranks, e.g. 1M, 250k, 5e6, or all (default: 1,048,576, or the "
               "whole test split if smaller).")
# The option panels of --help, by job.
LOSS, SAMPLES, TASKS = "Loss and perplexity", "Samples", "Downstream tasks"
COMPARE, WATCH, HEALTH = "Comparing runs", "Watching a run", "Run health"


@app.command("eval", epilog=epilog(ABOUT, EXAMPLES))
def eval_command(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN", help="One run directory, or several to compare."),
    checkpoint: str = typer.Option("latest", "--checkpoint", metavar="CHECKPOINT", help="latest, best, or a "
                                   "checkpoint directory."),
    device: str | None = typer.Option(None, "--device", metavar="DEVICE", rich_help_panel=DEVICES_PANEL,
                                      help="Evaluate on this device: cpu, cuda, cuda:1 (default: this rank's GPU, "
                                      "else the CPU)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", metavar="N", rich_help_panel=DEVICES_PANEL,
                                       help="Processes (GPUs) on this node; > 1 starts torchrun."),
    data: Path | None = typer.Option(None, "--data", metavar="DIR", rich_help_panel=LOSS, help="Evaluate on this "
                                     "dataset's test split instead of the run's: a dataset directory made with the "
                                     "run's tokenizer."),
    tokens: str = typer.Option("1048576", "--tokens", metavar="N", rich_help_panel=LOSS, help=TOKENS_HELP),
    micro_batch_size: int | None = typer.Option(None, "--micro-batch-size", min=1, metavar="N", rich_help_panel=LOSS,
                                                help="Sequences per forward pass (default: the run's "
                                                "micro_batch_size)."),
    no_loss: bool = typer.Option(False, "--no-loss/--loss", rich_help_panel=LOSS, help="No test loss: samples and "
                                 "--tasks only, which need no dataset (the checkpoint carries its tokenizer); writes "
                                 "no eval.json (--loss: measure it, the default)."),
    prompts: list[str] | None = typer.Option(None, "--prompt", metavar="TEXT", rich_help_panel=SAMPLES,
                                             help="Prompt to continue (repeatable; default: an empty prompt (a new "
                                             "document), 'def' and 'The')."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1, metavar="N", rich_help_panel=SAMPLES,
                                       help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.8, "--temperature", min=0.0, metavar="TEMP", rich_help_panel=SAMPLES,
                                      help="Sampling temperature; 0 is greedy."),
    top_k: int = typer.Option(50, "--top-k", min=0, metavar="K", rich_help_panel=SAMPLES,
                              help="Sample from the k most likely tokens; 0: all."),
    seed: int = typer.Option(0, "--seed", metavar="N", rich_help_panel=SAMPLES,
                             help="Sampling seed: the same seed gives the same text."),
    no_samples: bool = typer.Option(False, "--no-samples/--samples", rich_help_panel=SAMPLES, help="Skip generation "
                                    "(--samples: generate, the default)."),
    tasks: str | None = typer.Option(None, "--tasks", metavar="TASKS", rich_help_panel=TASKS, help="Downstream "
                                     "tasks, comma-separated, scored as lm-evaluation-harness scores them: "
                                     "hellaswag, arc_easy, arc_challenge, piqa, lambada_openai, winogrande, or all."),
    limit: int | None = typer.Option(None, "--limit", min=1, metavar="N", rich_help_panel=TASKS,
                                     help="With --tasks: the first N examples of each task (default: all)."),
    task_data: Path | None = typer.Option(None, "--task-data", metavar="DIR", rich_help_panel=TASKS, help="With "
                                          "--tasks: read TASK.jsonl (or a save_to_disk folder TASK/) from this "
                                          "directory instead of the hub."),
    harness: str | None = typer.Option(None, "--harness", metavar="TASKS", rich_help_panel=TASKS, help="Also score "
                                       "these tasks (comma-separated, or all) with lm-evaluation-harness itself, on "
                                       "the checkpoint exported to a temporary directory; printed beside nanopt's. "
                                       "Needs pip install \"nanopt[harness]\"."),
    price_per_hour: float | None = typer.Option(None, "--price-per-hour", min=0.0, metavar="USD",
                                                rich_help_panel=COMPARE, help="USD per GPU-hour, for the training "
                                                "cost: price x GPUs (ranks) x training hours."),
    chart: Path | None = typer.Option(None, "--chart", metavar="FILE", rich_help_panel=COMPARE, help="With several "
                                      "runs: the PNG overlaying their train and validation loss against tokens "
                                      "(default: compare.png beside the first run). Replaces only a chart nanopt "
                                      "drew."),
    fresh: bool = typer.Option(False, "--fresh/--no-fresh", rich_help_panel=COMPARE, help="With several runs, "
                               "evaluate each even if an eval.json for the same checkpoint and settings exists."),
    watch: bool = typer.Option(False, "--watch/--no-watch", rich_help_panel=WATCH, help="Score every new checkpoint "
                               "of RUN as training writes it, in this process, until the run is complete or Ctrl-C; "
                               "results go to eval_history.jsonl. E.g. nanopt eval runs/demo --watch --device cpu"),
    poll: float = typer.Option(30.0, "--poll", metavar="SECONDS", rich_help_panel=WATCH,
                               help="With --watch: seconds between looks for new checkpoints."),
    health: bool = typer.Option(False, "--health/--no-health", rich_help_panel=HEALTH, help="Only the run's health, "
                                "from its metrics.jsonl (running or finished; no checkpoint, no GPU): verdicts, latest "
                                "signals, and RUN/health.png charting them."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the results as JSON."),
) -> None:
    """Held-out test loss, perplexity and bits per byte of a checkpoint, with samples; several runs: a table."""
    from nanopt.evaluate import compare

    if health:
        from nanopt.cli.display.health import show_health

        show_health(run_dirs, as_json)
        return

    check_price_per_hour(price_per_hour)  # now, not after torchrun started and every checkpoint was read
    task_options(tasks, limit, task_data, harness)  # a misspelt task fails now too
    harness_opts = harness_options(harness, limit, task_data, nproc_per_node)  # and a missing harness extra
    from nanopt.cli.commands.eval_watch import check_device_option, check_watch_options

    check_device_option(device, nproc_per_node)
    if watch:
        check_watch_options(run_dirs, nproc_per_node, poll)
    overlay = len(run_dirs) > 1 and not no_loss
    if overlay:
        from nanopt.evaluate.charts import check_chart_path, default_chart_path

        chart = chart or default_chart_path(run_dirs)
        check_chart_path(chart)  # before any evaluation: a file that is not nanopt's chart stays untouched
    launch_if_asked(nproc_per_node)
    from nanopt.evaluate.report import EvalOptions, evaluate_runs
    from nanopt.evaluate.samples import DEFAULT_PROMPTS, SampleSettings

    samples = None if no_samples else SampleSettings(
        prompts=tuple(prompts) if prompts else DEFAULT_PROMPTS, max_new_tokens=max_new_tokens,
        temperature=temperature, top_k=top_k or None, seed=seed)
    opts = EvalOptions(checkpoint=checkpoint, data=data, tokens=_token_count(tokens),
                       micro_batch_size=micro_batch_size, samples=samples, loss=not no_loss,
                       reuse=len(run_dirs) > 1 and not fresh, tasks=task_options(tasks, limit, task_data, harness),
                       harness=harness_opts)
    if watch:
        from nanopt.cli.commands.eval_watch import watch as watch_run

        return watch_run(run_dirs[0], opts, poll, device, as_json, _RichProgress())
    is_main = ranks().is_main
    results = evaluate_runs(run_dirs, opts, _RichProgress() if is_main else None, device)
    if not is_main:
        return
    _print_checkpoint_notes(results)
    if no_loss:
        _render_without_loss(results, as_json)
        if not as_json:
            render_tasks(results)
        return
    rows = compare.ranked(results, price_per_hour)
    drawn = None
    if overlay:
        from nanopt.evaluate.charts import write_comparison_chart

        drawn = write_comparison_chart([Path(r["run"]) for r in rows], chart)
    if as_json:
        print_json(rows[0] if len(rows) == 1 else {"runs": rows, "notes": compare.notes(rows), "chart": str(drawn),
                                                   "settings_differ": differences(rows)})
    elif len(rows) == 1:
        _render_one(rows[0])
        render_tasks(rows)
    else:
        _render_comparison(rows, compare.notes(rows))
        render_tasks(rows)
        console().print(escape(f"chart: {drawn} (train and validation loss of {len(rows)} runs, against tokens)"))


def _print_checkpoint_notes(results: list[dict[str, Any]]) -> None:
    """On stderr, before the results: which checkpoint was used when `latest` could not be, and a checkpoint that
    training removed while it was evaluated."""
    for r in results:
        for note in r.get("notes") or []:
            console(stderr=True).print(f"[yellow]note:[/] {escape(r['run'])}: {escape(note)}", soft_wrap=True)


def _token_count(text: str) -> int | None:
    from nanopt.data.budget import parse_token_count

    return None if text.strip().lower() == "all" else parse_token_count(text, "--tokens")


class _RichProgress:
    """A transient progress bar on stderr, so --json stdout stays clean."""

    def __init__(self) -> None:
        self.bar: Any = None

    def start(self, description: str, total_batches: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        out = console(stderr=True)
        # Off when stderr is no terminal: a transient bar still leaves an empty line in a log or a pipe.
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("batches"), TimeRemainingColumn(), console=out, transient=True,
                            disable=not out.is_terminal)
        self.bar.start()
        self.task = self.bar.add_task(f"eval {escape(description)}", total=total_batches)

    def advance(self) -> None:
        self.bar.advance(self.task)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


# ---------------------------------------------------------------------------------------------------- rendering


def _render_one(r: dict[str, Any]) -> None:
    out = console()
    title = f"nanopt eval: {r['run']} at step {r['step']:,}" + (" (reused eval.json)" if r.get("reused") else "")
    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    sources = r.get("sources") or {}  # a mixture: each source on its own test split
    split = f"{len(sources)} sources" if sources else r["dataset"]
    rows = [
        ("checkpoint", r["checkpoint"]),
        ("test split", f"{split}: {r['tokens']:,} of {r['split_tokens']:,} tokens evaluated "
                       f"({fmt.percent(r['tokens'] / r['split_tokens'])}), {r['bytes_per_token']:.3f} bytes per token"),
        ("test loss", f"{r['test_loss']:.4f} nats per token"),
        ("perplexity", f"{r['perplexity']:.2f}"),
        ("bits per byte", f"{r['bits_per_byte']:.4f}"),
        ("parameters", f"{fmt.exact(r['parameters'])} ({fmt.count(r['parameters'])})"),
        ("tokens trained", f"{fmt.count(r['tokens_trained'])} in batches of {fmt.exact(r['global_batch_tokens'])}"),
        ("training time", _training_time(r)),
        ("tokenizer", r["tokenizer_check"]),
        ("evaluated on", f"{r['world_size']} x {r['device']} {r['precision']} in {fmt.duration(r['eval_seconds'])}"),
    ]
    rows[3:3] = [(f"  source {name}", f"{part['test_loss']:.4f} nats per token over {part['tokens']:,} tokens, "
                                      f"{part['bits_per_byte']:.4f} bits per byte ({part['dataset']})")
                 for name, part in sources.items()]
    for label, value in rows:
        table.add_row(label, escape(value))
    out.print(table)
    if r.get("time"):
        out.print(fmt.phase_table(r["time"], f"time and cost per phase to step {r['step']:,}"))
    if r.get("prediction"):
        out.print(prediction_table(r["prediction"]))
    _render_samples(r)


def _render_comparison(rows: list[dict[str, Any]], notes: list[str]) -> None:
    from nanopt.evaluate.compare import device_hours_label

    out = console()
    # What is compared first, then what it took. Perplexity is left out: it is exp(test loss), in the JSON. "batch" is
    # the global batch in tokens. A narrow terminal (80 columns) gets the columns over several tables, each
    # with the rank: no number is cut short, and --json has everything.
    headers = ["#", "run", "test loss", "bits/byte", "step", "params", "tokens", "batch", "wall time",
               device_hours_label(rows), "cost", "w/o eval"]
    records = [[str(rank), escape(r["run"]), f"{r['test_loss']:.4f}", f"{r['bits_per_byte']:.4f}", f"{r['step']:,}",
                fmt.count(r["parameters"]), fmt.count(r["tokens_trained"]), fmt.exact(r["global_batch_tokens"]),
                fmt.duration(r["wall_seconds"] if r["wall_seconds"] is not None else r["train_seconds"]),
                "-" if r["gpu_hours"] is None else f"{r['gpu_hours']:.2f}", fmt.money(r["cost_usd"]),
                fmt.money(r["cost_excluding_eval_usd"])] for rank, r in enumerate(rows, 1)]
    fmt.print_records(out, "nanopt eval: runs by test loss", headers, records, left=frozenset({"run"}))
    _render_settings_differ(rows)
    timed = [(rank, r) for rank, r in enumerate(rows, 1) if r.get("time")]
    if timed:
        phases = list(fmt.PHASE_LABELS)
        fmt.print_records(out, "time per phase (share of the run's wall time)", ["#", "run", *phases],
                          [[str(rank), escape(r["run"]), *(_phase_cell(r["time"]["phases"][name]) for name in phases)]
                           for rank, r in timed], left=frozenset({"run"}))
    for note in notes:
        out.print(f"note: {escape(note)}")
    for r in rows:
        _render_samples(r)


def _render_settings_differ(rows: list[dict[str, Any]]) -> None:
    """The model.json and train.json keys whose values differ between the runs, a column per run in the order
    above; one line when none do (nanopt.evaluate.settings_diff: which keys count)."""
    found = differences(rows)
    if not found:
        console().print("settings: the runs were trained with the same model.json and train.json (logging, "
                        "evaluation and checkpoint settings aside)")
        return
    headers = ["setting", *(escape(r["run"]) for r in rows)]
    records = [[escape(d["setting"]), *(escape(shown(value)) for value in d["values"])] for d in found]
    fmt.print_records(console(), "settings that differ, as trained", headers, records, left=frozenset(headers))


def _phase_cell(phase: dict[str, Any]) -> str:
    return f"{fmt.duration(phase['seconds'])} ({fmt.percent(phase['share'])})"


def _training_time(r: dict[str, Any]) -> str:
    if r.get("time"):
        t = r["time"]
        return (f"{fmt.duration(t['wall_seconds'])} wall ({t['sessions']} session(s)), "
                f"{fmt.duration(t['phases']['train']['seconds'])} of steps, {t['device_hours']:.3f} device-hours"
                + (f", {fmt.money(t['cost_usd'])}" if t["cost_usd"] is not None else ""))
    if r["train_seconds"] is None:
        return "- (no step times in metrics.jsonl)"
    text = f"{fmt.duration(r['train_seconds'])} of steps on {r['train_world_size']} rank(s)"
    return text + (f", {fmt.money(r['cost_usd'])}" if r.get("cost_usd") is not None else "")


def _render_without_loss(results: list[dict[str, Any]], as_json: bool) -> None:
    """--no-loss: a heading per run that says what follows (samples, downstream tasks, the harness's scores),
    then its samples; the tasks' table comes after every run's."""
    if as_json:
        print_json(results[0] if len(results) == 1 else {"runs": results, "settings_differ": differences(results)})
        return
    if len(results) > 1:
        _render_settings_differ(results)
    for r in results:
        console().print(escape(f"nanopt eval: {r['run']} at step {r['step']:,}: {_shown_without_loss(r)} (--no-loss: "
                               f"no test loss); tokenizer: {r['tokenizer_check']}"))
        _render_samples(r)


def _shown_without_loss(r: dict[str, Any]) -> str:
    """What a --no-loss result holds, as its heading names it: "samples only", "samples and downstream tasks", ..."""
    parts = [name for name, present in (("samples", r["settings"]["samples"] is not None),
                                        ("downstream tasks", bool(r.get("tasks"))),
                                        ("lm-evaluation-harness scores", bool(r.get("harness")))) if present]
    text = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
    return text + " only" if len(parts) == 1 else text


def _render_samples(r: dict[str, Any]) -> None:
    out = console()
    for sample in r["samples"]:
        prompt = sample["prompt"]
        title = f"{r['run']}: {prompt!r}" if prompt else f"{r['run']}: (a new document)"
        ending = escape("[EOS]") if sample["ended"] else "..."
        body = (f"[bold]{escape(prompt)}[/]{escape(sample['completion'])}[dim]{ending}[/]\n"
                f"[dim]{escape(_how_it_stopped(sample))}[/]")
        out.print(Panel(body, title=escape(title), title_align="left", expand=False))


def _how_it_stopped(sample: dict[str, Any]) -> str:
    """How many tokens a sample produced and why it stopped (an eval.json from before nanopt recorded why says
    only whether it ended with EOS)."""
    count = sample["new_tokens"]
    produced = f"{count:,} new token{'' if count == 1 else 's'}"
    stopped = sample.get("stopped", "eos" if sample["ended"] else None)
    if stopped == "eos":
        return f"{produced}, ended with the end-of-text token"
    if stopped == "max_new_tokens":
        return f"{produced}: stopped at --max-new-tokens"
    if stopped == "context_limit":
        positions = 1 + sample["prompt_tokens"] + count  # the EOS that starts the document, prompt, continuation
        return (f"{produced}: stopped at the model's context limit ({positions:,} positions, "
                "max_position_embeddings)")
    return produced
