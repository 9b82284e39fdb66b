"""`nanopt estimate`: parameters, tokens, FLOPs, time, cost and memory before a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import SET_HELP, app, console, load_run_config, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.display.estimate_ladder import checkpointing_words, print_compared, print_ladder
from nanopt.cli.display.mixture import plan_table, plan_warnings
from nanopt.cli.helptext import epilog
from nanopt.errors import ConfigError
from nanopt.hardware import ALIASES, CPU, DEFAULT_GPU, GPUS
from nanopt.plan.estimate import DEFAULT_MFU
from nanopt.plan.planned_rate import SOURCE as PLANNED
from nanopt.plan.planned_rate import describe as describe_planned

ABOUT = """
The memory ladder lists every rung at --num-gpus (parallelism ddp, zero1, zero2, fsdp, fsdp_offload, each with
activation checkpointing off, selective, every 2nd block or all, and 8-bit AdamW moments for an AdamW run) with its
memory per GPU and projected slowdown against DDP, and recommends the fastest that fits, with the --set options for
train, find-batch and preflight. It is the one source of layout advice: the parallelism table gives its
recommendation for 1, 2, 4, 8, 16, 32 and 64 GPUs (and --num-gpus), or by how much nothing fits, and whether
train.json's own layout fits; the memory verdict says whether the run fits at its micro_batch_size and, if not, which
settings would (a smaller micro-batch, the ladder's recommendation, or the fewest GPUs where a rung fits and the
ladder's recommendation there), each checked with the same memory model.

Throughput is an assumed MFU of the device's peak, unless the run directory holds a preflight.json (`nanopt preflight`)
measured with the run's current settings on the estimated device and GPU count, and no --mfu is given: then time and
cost come from the measured tokens/s, and the table says so. Without --gpu, the estimate is for the preflight's device.
A CPU run that `nanopt plan` wrote, with its settings still as planned, is estimated at the MFU the plan measured.

--flops C plans a run from a compute budget: N = sqrt(C / (6 x ratio)) parameters and D = ratio x N tokens (C = 6ND,
--chinchilla-ratio tokens per parameter), the time and cost of C FLOPs at the assumed MFU, and the most balanced
model of the family (layers, width, heads) whose exact parameter count is within 2% of N; --write-model saves it.
"""

EXAMPLES = """
nanopt estimate runs/gpt2-small
nanopt estimate runs/llama-3.2-1b --gpu h100-sxm --num-gpus 8 --mfu 0.45 --price-per-hour 2.50
nanopt estimate runs/smollm-360m --hours 24          # how many tokens fit in a day?
nanopt estimate --params 7e9 --gpu a100-80gb --num-gpus 64
nanopt estimate runs/gpt2-small --gpu-memory 40GiB --json
nanopt estimate runs/gpt2-small --gpu l40s --hours 12   # short names work too: --gpu h100, a100, 4090
nanopt estimate runs/demo --gpu cpu                      # this machine: its cores' peak, its memory
nanopt estimate runs/llama-3.2-1b --gpu rtx-4090        # too big? says what fits: FSDP on N GPUs, checkpointing
nanopt estimate runs/demo                                # after a preflight of runs/demo: what it measured
nanopt estimate runs/llama-3.2-1b --gpu rtx-4090 --num-gpus 8   # which layout fits on 1 to 64 GPUs; is mine one?
nanopt estimate --flops 1e21 --gpu h100 --num-gpus 8    # plan from a compute budget: the optimal model and tokens
nanopt estimate --flops 3e19 --family gpt2 --chinchilla-ratio 100 --write-model runs/new/model.json
nanopt estimate runs/smollm-360m --flops 1e20           # a model of this run's family (vocab, GQA, options)
nanopt estimate runs/gpt2-small --compare-gpus --num-gpus 8      # every GPU of the table, cheapest per token first
"""

# The option panels of --help, by job.
HARDWARE, BUDGET = "Hardware and cost", "Model size and token budget"


@app.command("estimate", epilog=epilog(ABOUT, EXAMPLES))
def estimate_command(
    run_dir: Path | None = typer.Argument(None, metavar="RUN", help="Run directory with model.json and train.json."),
    sets: list[str] | None = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    gpu: str | None = typer.Option(None, "--gpu", metavar="GPU", rich_help_panel=HARDWARE,
                                   help=f"GPU from the table: {', '.join(GPUS)}; or a short name "
                                   f"({', '.join(ALIASES)}), with a note saying which card it means; or {CPU}: this "
                                   "machine's processor (peak from its cores, clock and vector units) and memory, no "
                                   "price unless --price-per-hour. Default: the device of the run's preflight.json, "
                                   f"else {DEFAULT_GPU}."),
    num_gpus: int | None = typer.Option(None, "--num-gpus", metavar="N", rich_help_panel=HARDWARE,
                                        help="GPUs in the run (also the DDP / FSDP world size; the parallelism table "
                                        "marks its row). Default: the preflight's ranks when estimating for its "
                                        "device, else 1."),
    mfu: float | None = typer.Option(None, "--mfu", metavar="FRACTION", rich_help_panel=HARDWARE,
                                     help="Model FLOPs utilization to assume, as a fraction of the peak: 0.4 means "
                                     "40% (0 < MFU <= 1; a percentage such as 40 is refused). Default: the throughput "
                                     f"`nanopt preflight` measured for this run on this device, else {DEFAULT_MFU:g}."),
    price_per_hour: float | None = typer.Option(None, "--price-per-hour", metavar="USD", rich_help_panel=HARDWARE,
                                                help="USD per GPU-hour (default: train.json price_per_hour, else the "
                                                "table's typical price; none for --gpu cpu)."),
    peak_tflops: float | None = typer.Option(None, "--peak-tflops", metavar="TFLOPS", rich_help_panel=HARDWARE,
                                             help="Dense peak TFLOP/s per GPU, overriding the table."),
    gpu_memory: str | None = typer.Option(None, "--gpu-memory", metavar="SIZE", rich_help_panel=HARDWARE,
                                          help="Usable GPU memory, e.g. 40GiB (with --gpu cpu: the memory training "
                                          "may use)."),
    compare: bool = typer.Option(False, "--compare-gpus/--no-compare-gpus", rich_help_panel=HARDWARE,
                                 help="Also the run on --num-gpus of every GPU in the table: the ladder's rung for "
                                      "each, time, cost and dollars per million tokens, cheapest first."),
    params: float | None = typer.Option(None, "--params", metavar="N", rich_help_panel=BUDGET,
                                        help="Estimate from a parameter count instead (e.g. 7e9); FLOPs use 6N."),
    tokens: float | None = typer.Option(None, "--tokens", metavar="N", rich_help_panel=BUDGET,
                                        help="With --params: token budget (default: Chinchilla-optimal)."),
    hours: float | None = typer.Option(None, "--hours", metavar="HOURS", rich_help_panel=BUDGET,
                                       help="Inverse question: the tokens that fit in this many hours."),
    chinchilla_ratio: float = typer.Option(20.0, "--chinchilla-ratio", metavar="RATIO", rich_help_panel=BUDGET,
                                           help="Chinchilla tokens per parameter (with --flops: the D / N of the "
                                           "plan; above 20 over-trains a smaller model)."),
    flops: float | None = typer.Option(None, "--flops", metavar="C", rich_help_panel=BUDGET,
                                       help="Plan from a compute budget of C training FLOPs (e.g. 1e21): the "
                                       "compute-optimal parameters and tokens, and a model shape of that size."),
    family: str | None = typer.Option(None, "--family", metavar="llama|gpt2", rich_help_panel=BUDGET,
                                      help="With --flops and no run directory: llama (default, Llama 3.2's "
                                      "vocabulary and grouping) or gpt2."),
    write_model: Path | None = typer.Option(None, "--write-model", metavar="FILE", rich_help_panel=BUDGET,
                                            help="With --flops: write the planned model as this new model.json."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print one JSON object instead of tables."),
) -> None:
    """Params, FLOPs, Chinchilla budget, time, cost and memory per GPU for a run, before renting a GPU, and
    whether it fits."""
    from nanopt.hardware import parse_size
    from nanopt.plan.estimate import EstimateOptions, estimate
    from nanopt.plan.estimate.budget import write_model_json

    run = load_run_config(run_dir, sets) if run_dir is not None else None
    opts = EstimateOptions(
        gpu=gpu, num_gpus=num_gpus, mfu=mfu, price_per_hour=price_per_hour, peak_tflops=peak_tflops,
        gpu_memory=parse_size(gpu_memory) if gpu_memory is not None else None, hours=hours,
        tokens_per_param=chinchilla_ratio, params=params, tokens=tokens, flops=flops, family=family,
        compare_gpus=compare)
    if write_model is not None and flops is None:
        raise ConfigError("--write-model without --flops: it writes the model --flops plans",
                          "add --flops C, e.g. --flops 1e21")
    report = estimate(run, opts)
    if run is not None and run.mixture is not None:  # what each source of a mixture gives the run
        from nanopt.data.mixtures.mixture_plan import plan_records

        report["sources"], report["data_epochs_warning"] = plan_records(run), run.train.data_epochs_warning
    if write_model is not None:
        write_model_json(write_model, report["model"])
        report["model_json_written"] = str(write_model)
    if flops is not None:
        print_json(report) if as_json else render_budget(report)
        return
    for note in (report["gpu"]["note"], report["throughput_source"]["note"]):
        if note:  # on stderr, so that --json stdout stays one JSON object
            console(stderr=True).print(escape(f"note: {note}"), soft_wrap=True)
    if as_json:
        print_json(report)
    else:
        render(report)


def render(r: dict[str, Any]) -> None:
    out = console()
    g = r["gpu"]
    on = g["name"] if g["key"] == CPU else f"{g['num_gpus']} x {g['name']}"
    title = f"nanopt estimate: {r['run'] or 'params only'} on {on}"
    table = Table(title=escape(title), show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("parameters", f"{fmt.exact(r['params'])} ({fmt.count(r['params'])})"),
        ("non-embedding parameters", fmt.exact(r["non_embedding_params"])),
        ("FLOPs / token (attention incl.)", f"{fmt.sci(r['flops_per_token'])}   [{r['flops_formula']}]"),
        ("FLOPs / token (6N)", fmt.sci(r["flops_per_token_6n"])),
        ("Chinchilla-optimal tokens", f"{fmt.count(r['chinchilla_tokens'])} "
                                      f"({r['chinchilla_tokens_per_param']:g} per parameter)"),
        ("train tokens", f"{fmt.count(r['train_tokens'])} = {fmt.ratio(r['train_tokens_vs_chinchilla'])} x Chinchilla"),
        ("optimizer steps", fmt.exact(r["optimizer_steps"])),
        ("gradient accumulation", str(r["grad_accum"] if r["grad_accum"] is not None else "-")),
        *_batch_warmup_rows(r.get("batch_warmup")),
        *_stage_rows(r.get("seq_len_stages")),
        ("total training FLOPs", fmt.sci(r["total_flops"])),
        ("peak" if g["key"] == CPU else "peak per GPU", f"{_tflops(g['peak_tflops'])} ({g['peak_source']}), "
                                                         f"{_mfu_text(r)}"),
        ("throughput", f"{fmt.count(r['tokens_per_second'])} tokens/s{_throughput_text(r['throughput_source'])}"),
        ("wall-clock time", fmt.duration(r["train_seconds"])),
        ("cost", _cost(r["cost_usd"], g["usd_per_hour"], "hour" if g["key"] == CPU else "GPU-hour")),
    ]
    source = r["throughput_source"]
    if source["kind"] == "preflight" and source.get("projection_outdated"):
        rows.append(("whole run as preflight projects it", f"not shown: {source['projection_outdated']}"))
    elif source["kind"] == "preflight" and source["projected_total_seconds"] is not None:
        rows.append(("whole run as preflight projects it", f"{fmt.duration(source['projected_total_seconds'])}, "
                                                          f"{fmt.money(source['projected_cost_usd'])} (setup, "
                                                          "steps, evaluations, checkpoints)"))
    if r["hours"]:
        h = r["hours"]
        rows.append((f"in {h['hours']:g} hours", f"{fmt.count(h['tokens'])} tokens = "
                                                 f"{fmt.ratio(h['fraction_of_chinchilla'])} x Chinchilla, "
                                                 f"{fmt.money(h['cost_usd'])}"))
    for label, value in rows:
        table.add_row(label, escape(value))  # the run's name, preflight.json's device and time
    out.print(table)
    if r.get("sources"):
        out.print(plan_table(r["sources"], "data mixture: tokens each source gives the run"))
        for warning in plan_warnings(r["sources"], r["data_epochs_warning"]):
            out.print(f"[bold yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    out.print(_memory_table(r))
    if r["parallelism"] is not None:
        _print_parallelism(r["parallelism"])
    if r["ladder"] is not None:
        print_ladder(r["ladder"])
    _print_verdict(r["fit"])
    if r["compare_gpus"] is not None:
        print_compared(r["compare_gpus"])
    if r["attention"] is not None and r["attention"]["warning"]:
        out.print(f"[bold yellow]warning:[/] {escape(r['attention']['warning'])}", soft_wrap=True)


def render_budget(r: dict[str, Any]) -> None:
    g, m = r["gpu"], r["model"]
    on = g["name"] if g["key"] == CPU else f"{g['num_gpus']} x {g['name']}"
    table = Table(title=escape(f"nanopt estimate: a budget of {fmt.sci(r['flops'])} FLOPs on {on}"),
                  show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    heads = f"{m['num_attention_heads']} heads" + (f" ({m['num_key_value_heads']} KV)" if
                                                   m["num_key_value_heads"] != m["num_attention_heads"] else "")
    rows = [
        ("compute-optimal parameters", f"{fmt.exact(r['optimal_params'])} ({fmt.count(r['optimal_params'])})"),
        ("compute-optimal tokens", f"{fmt.exact(r['optimal_tokens'])} ({fmt.count(r['optimal_tokens'])}, "
                                   f"{r['tokens_per_param']:g} per parameter; C = 6ND)"),
        ("model", f"{m['architecture']}: {m['num_hidden_layers']} layers x {m['hidden_size']} wide, {heads}, "
                  f"MLP {m['intermediate_size']}, vocab {m['vocab_size']}, {m['max_position_embeddings']} positions"),
        ("its parameters", f"{fmt.exact(r['model_params'])} ({fmt.ratio(r['model_params_vs_optimal'])} x optimal)"),
        ("its tokens in the budget", f"{fmt.exact(r['model_tokens'])} ({fmt.count(r['model_tokens'])})"),
        ("peak" if g["key"] == CPU else "peak per GPU", f"{_tflops(g['peak_tflops'])} ({g['peak_source']}), "
                                                         f"assumed MFU {fmt.percent(g['mfu'])}"),
        ("wall-clock time", fmt.duration(r["train_seconds"])),
        ("cost", _cost(r["cost_usd"], g["usd_per_hour"], "hour" if g["key"] == CPU else "GPU-hour")),
    ]
    for label, value in rows:
        table.add_row(label, escape(value))
    console().print(table)
    if r["model_json_written"]:
        console().print(f"wrote {escape(r['model_json_written'])}", soft_wrap=True)


def _mfu_text(r: dict[str, Any]) -> str:
    measured = r["throughput_source"]["kind"] in ("preflight", PLANNED)
    mfu = fmt.percent(r["gpu"]["mfu"]) if r["gpu"]["mfu"] is not None else "implausible (above 100%)"
    return f"measured MFU {mfu}" if measured else f"assumed MFU {mfu}"


def _throughput_text(source: dict[str, Any]) -> str:
    if source["kind"] == PLANNED:
        return describe_planned(source)
    if source["kind"] != "preflight":
        return ""
    failed = (f"; its checks failed: {', '.join(source['failed_checks'])}" if source["failed_checks"] else "")
    return (f" (measured by nanopt preflight on {source['device']} at {source['measured_at']}, "
            f"{source['steps']} steps{failed})")


def _batch_warmup_rows(warmup: dict | None) -> list[tuple[str, str]]:
    if warmup is None:
        return []
    return [("batch warmup", f"from {fmt.exact(warmup['start_tokens'])} tokens a step over the first "
                             f"{fmt.count(warmup['tokens'])} tokens ({fmt.exact(warmup['steps'])} steps)")]


def _stage_rows(stages: list[dict] | None) -> list[tuple[str, str]]:
    if stages is None:
        return []
    return [("seq_len stages", "; ".join(f"{fmt.exact(s['seq_len'])} from step {fmt.exact(s['first_step'])} "
                                         f"({fmt.count(s['tokens'])} tokens, micro-batch {s['micro_batch_size']})"
                                         for s in stages) + "; memory at the longest")]


def _tflops(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1000:.1f} GFLOP/s"


def _cost(usd: float | None, usd_per_hour: float | None, unit: str) -> str:
    if usd_per_hour is None:
        return "- (your own machine: --price-per-hour prices it)"
    return f"{fmt.money(usd)} at ${usd_per_hour:.2f} / {unit}"


def _print_verdict(fit: dict[str, Any]) -> None:
    out = console()
    colour = "green" if fit["fits"] else "red"
    out.print(f"[bold {colour}]memory:[/] {escape(fit['verdict'])}")
    for remedy in fit["remedies"]:
        out.print(f"  - {escape(remedy['text'])}")


def _memory_table(r: dict[str, Any]) -> Table:
    m = r["memory_bytes"]
    a = r["memory_assumptions"]
    on_cpu = r["gpu"]["key"] == CPU
    settings = (f" ({a['precision']}, compile {'on' if a['compile'] else 'off'}, activation checkpointing "
                f"{checkpointing_words(a['activation_checkpointing'])}, {a['parallelism']} x {a['world_size']})"
                if a else "")
    stage = f", at the longest seq_len stage: {a['seq_len']:,}" if a and r.get("seq_len_stages") else ""
    title = ("memory" if on_cpu else "memory per GPU") + settings + stage
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    table.add_row("weights (fp32 master)", fmt.size(m["weights"]))
    table.add_row("gradients (fp32)", fmt.size(m["gradients"]))
    table.add_row("optimizer (AdamW moments)", fmt.size(m["optimizer"]))
    table.add_row("activations per sequence", fmt.size(m["activations_per_sequence"]))
    if m.get("loss_buffers") or m.get("loss_chunk"):
        table.add_row("loss (head gradient, one chunk)", fmt.size(m["loss_buffers"] + m["loss_chunk"]))
    if m.get("weight_copies"):
        table.add_row("weight copies (eager autocast)", fmt.size(m["weight_copies"]))
    if m.get("health_snapshot"):
        table.add_row("run health's weight copy (log steps' update)", fmt.size(m["health_snapshot"]))
    table.add_row("runtime overhead (Python, torch)" if on_cpu else "runtime overhead (CUDA context, workspaces)",
                  fmt.size(m["runtime_overhead"]))
    if a:
        table.add_row(f"total at micro-batch {a['micro_batch_size']}", fmt.size(m["total"]))
    table.add_row("RAM" if on_cpu else "GPU memory", fmt.size(r["gpu_memory_bytes"]))
    table.add_row("predicted largest micro-batch", str(r["max_micro_batch"] if r["max_micro_batch"] is not None
                                                        else "-"))
    return table


def _print_parallelism(p: dict[str, Any]) -> None:
    """One line per GPU count: the memory ladder's recommendation there, its memory per GPU, and train.json's own
    layout."""
    out = console()
    table = Table(title=f"parallelism: the memory ladder's recommendation for each GPU count of "
                        f"{fmt.size(p['gpu_memory_bytes'])}",
                  title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1, 0, 0),
                  caption=f"train.json: its own layout, {p['run_layout']['name']}; batch: the global batch does not "
                          "split over this many GPUs (the note below); ckpt: activation checkpointing; none: no rung "
                          "fits (the leanest shown); free: headroom (-: over); *: --num-gpus")
    for header in ("GPUs", "layout", "per GPU", "free", "micro-batch", "slowdown", "train.json"):
        table.add_column(header, justify="left" if header in ("layout", "micro-batch", "train.json") else "right",
                         no_wrap=True)
    for row in p["rows"]:
        own, this_run = row["run_layout"], row["gpus"] == p["run_gpus"]
        name = escape(row["layout"]["name"])
        table.add_row(
            f"{row['gpus']} *" if this_run else str(row["gpus"]),
            name if row["fits"] else f"[red]none[/] ({name})",
            fmt.size(row["memory_bytes"]), _signed(row["headroom_bytes"]),
            f"{row['micro_batch_size']} (max {row['max_micro_batch']})", f"{row['slowdown']:.2f}x",
            _own_cell(own, p["gpu_memory_bytes"]),
            style="bold" if this_run else None)
    out.print(table)
    for row in p["rows"]:
        if row["note"]:
            out.print(f"  {escape(str(row['gpus']))} GPUs: {escape(row['note'])}", soft_wrap=True)


def _own_cell(own: dict[str, Any], gpu_memory: int) -> str:
    """train.json's column: fits, batch (it does not split over these GPUs: the row's note), or by how much its
    memory is over."""
    if own["fits"]:
        return "fits"
    return "[red]batch[/]" if not own["batch_splits"] else f"[red]{_signed(gpu_memory - own['memory_bytes'])}[/]"


def _signed(free: int) -> str:
    return fmt.size(free) if free >= 0 else f"-{fmt.size(-free)}"
