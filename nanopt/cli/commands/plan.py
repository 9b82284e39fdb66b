"""`nanopt plan`: from a budget (money, time or FLOPs) on a device to a new run directory, ready to train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import app, console, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.helptext import epilog
from nanopt.hardware import ALIASES, CPU, DEFAULT_GPU, GPUS
from nanopt.untrusted_text import shell_word

ABOUT = """
The budget becomes the training steps' FLOPs: a time or money budget less a setup allowance and the shares kept
for evaluation (2%), checkpoints (1%) and other time (1%), at the device's dense peak x the assumed MFU (0.4, or
--mfu), slowed by the memory ladder's rung. Those FLOPs give the compute-optimal size (20 tokens per parameter)
and the most balanced shape of the family near it, its sequence length, and the tokens it trains on. On --gpu cpu
(this machine) with no --mfu, a few real steps of the planned model are then timed here and the plan made again
at the MFU they ran at: on a CPU no single assumed MFU fits.

The peak learning rate and the global batch are DeepSeek LLM's fits (Bi et al. 2024, arXiv:2401.02954) at that
compute: eta = 0.3118 C^-0.125 and B = 0.2920 C^0.3271 tokens, C = M x D with M the non-embedding FLOPs per token.
Warmup is 5% of the steps (10 to 2000), the schedule cosine to 10%, AdamW 0.9 / 0.95, weight decay 0.1,
clipping 1.0. The micro-batch is the largest the memory model fits at the memory ladder's fastest rung;
evaluation stays under 2% of the time, and a kill loses at most 1% of the steps' time or 30 minutes (less often
where saving would cost more than 1%: the plan says what a kill then loses).

It writes RUN/model.json, train.json and plan.json (every choice and its reason) and nothing else; refusals (a
dataset read more than --max-epochs times, a budget below the smallest sensible model, RUN already there) are
one line before anything is written. `nanopt train RUN` records its own prediction in RUN/prediction.json before
the first step, and shows it against what it measured at the end; so does `nanopt eval RUN`. docs/budget.md walks
through a budget to an evaluated model.
"""

EXAMPLES = """
nanopt tokenize --out data/stdlib                                   # the built-in corpus, once
nanopt plan --budget 2min --gpu cpu --data data/stdlib --out runs/two-minutes
nanopt train runs/two-minutes                                       # shows predicted against measured at the end
nanopt eval runs/two-minutes
nanopt plan --budget 20USD --gpu cpu --price-per-hour 0.10 --data data/stdlib --out runs/twenty-dollars
nanopt tokenize HuggingFaceFW/fineweb-edu --config sample-10BT --tokenizer gpt2 --max-tokens 10B --out data/fineweb
nanopt plan --budget 500USD --gpu h100-sxm --num-gpus 8 --data data/fineweb --out runs/five-hundred
nanopt plan --budget 24h --gpu h100 --num-gpus 8 --family gpt2 --data data/fineweb --out runs/one-day
nanopt plan --budget 1e19 --gpu a100-80gb --num-gpus 4 --data data/fineweb --out runs/1e19 --json
"""

HARDWARE = "Hardware and cost"
PHASE_NAMES = (("setup", "setup"), ("train", "steps"), ("eval", "evaluation"), ("checkpoint", "checkpoints"),
               ("other", "other"))


@app.command("plan", epilog=epilog(ABOUT, EXAMPLES))
def plan_command(
    budget: str = typer.Option(..., "--budget", metavar="BUDGET", help="What to spend: money (500USD), wall-clock "
                               "time of the whole run (24h, 90min, 45s) or the training steps' FLOPs (1e19)."),
    data: Path = typer.Option(..., "--data", metavar="DIR", help="The dataset `nanopt tokenize` made: its tokenizer "
                              "sets the vocabulary, its splits' sizes what the budget may read."),
    out: Path = typer.Option(..., "--out", "-o", metavar="RUN",
                             help="The new run directory to write (must not exist, or be empty)."),
    gpu: str = typer.Option(DEFAULT_GPU, "--gpu", metavar="GPU", rich_help_panel=HARDWARE,
                            help=f"GPU from the table: {', '.join(GPUS)}; a short name ({', '.join(ALIASES)}); or "
                            f"{CPU}: this machine's processor and memory."),
    num_gpus: int = typer.Option(1, "--num-gpus", metavar="N", rich_help_panel=HARDWARE, help="GPUs the run trains "
                                 "on (DDP / FSDP world size)."),
    price_per_hour: float | None = typer.Option(None, "--price-per-hour", metavar="USD", rich_help_panel=HARDWARE,
                                                help="USD per GPU-hour (default: the table's typical price; a CPU has "
                                                "none, so a budget in USD on --gpu cpu needs it). Written into "
                                                "train.json."),
    mfu: float | None = typer.Option(None, "--mfu", metavar="FRACTION", rich_help_panel=HARDWARE,
                                     help="Model FLOPs utilization to assume (default 0.4). With --gpu cpu and no "
                                     "--mfu the plan measures a few steps of the planned model on this machine "
                                     "instead (seconds)."),
    family: str = typer.Option("llama", "--family", metavar="llama|gpt2", help="The architecture: llama (RoPE, "
                               "SwiGLU, grouped KV heads) or gpt2."),
    max_epochs: float = typer.Option(4.0, "--max-epochs", metavar="N", help="Refuse a plan that reads the train "
                                     "split more than N times."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the plan (plan.json) as JSON."),
) -> None:
    """From a budget to a run: the compute-optimal model, tokens, learning rate, batch, memory rung and eval and
    checkpoint intervals for a GPU (or this CPU), written as a new run directory with its predicted time and cost."""
    from nanopt.plan.recipe import PlanOptions, check_out, make_plan, write_run

    check_out(out)
    plan = make_plan(PlanOptions(budget=budget, data=data, out=out, gpu=gpu, num_gpus=num_gpus,
                                 price_per_hour=price_per_hour, family=family, mfu=mfu, max_epochs=max_epochs),
                     on_measure=lambda what: console(stderr=True).print(escape(what), soft_wrap=True))
    write_run(plan, out)
    if as_json:
        print_json({k: v for k, v in plan.items() if k not in ("model_json", "train_json")})
    else:
        render(plan)


def _mfu_text(throughput: dict[str, Any], mfu: float) -> str:
    if throughput["source"] != "measured":
        return f"assumed MFU {fmt.percent(mfu)}"
    near = "" if throughput["of_this_shape"] else " of a model near this one"
    return f"MFU {fmt.percent(mfu)} measured on this CPU over {throughput['steps']} steps{near}"


def render(p: dict[str, Any]) -> None:
    out = console()
    d, m, s, c, pred = p["device"], p["model"], p["schedule"], p["cadence"], p["prediction"]
    on = d["name"] if d["gpu"] == CPU else f"{d['num_gpus']} x {d['name']}"
    table = Table(title=escape(f"nanopt plan: {p['budget']['as_said']} on {on} -> {p['run']}"), show_header=False,
                  title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    for label, value in _rows(p, d, m, s, c, pred):
        table.add_row(label, escape(value))
    out.print(table)
    if p["rule"]["note"]:
        out.print(f"[yellow]note:[/] {escape(p['rule']['note'])}", soft_wrap=True)
    out.print(escape(f"wrote {p['run']}: model.json, train.json, plan.json"), soft_wrap=True)
    out.print("next:")
    for command in p["next"]:
        out.print(f"  {escape(command)}", soft_wrap=True, highlight=False)


def _rows(p: dict[str, Any], d: dict, m: dict, s: dict, c: dict, pred: dict) -> list[tuple[str, str]]:
    r, b, data, seconds = p["rule"], p["batch"], p["data"], pred["seconds"]
    heads = f"{m['heads']} head{'s' if m['heads'] > 1 else ''}" + (
        f" ({m['kv_heads']} KV)" if m["kv_heads"] != m["heads"] else "")
    lost = (f"a kill loses at most {fmt.duration(c['lost_s'])} ({fmt.percent(c['lost_share'])} of the steps' time)"
            + (f", not {fmt.duration(c['lost_limit_s'])}: saving that often would cost more than "
               f"{fmt.percent(c['checkpoint_share_limit'])} of the time" if c["lost_by_cost"] else ""))
    return [
        ("compute", f"{fmt.sci(p['compute']['train_flops'])} FLOPs in the training steps ({_tflops(d)}, "
                    f"{_mfu_text(p['throughput'], d['mfu'])})"),
        ("model", f"{p['model_json']['architecture']}: {m['layers']} layers x {m['hidden_size']}, {heads}, vocab "
                  f"{m['vocab_size']:,}, seq_len {m['seq_len']:,}: {fmt.exact(m['params'])} parameters "
                  f"(compute-optimal: {fmt.count(p['compute']['optimal_params'])})"),
        ("tokens", f"{fmt.count(s['train_tokens'])} in {fmt.exact(s['steps'])} steps of "
                   f"{fmt.exact(b['global_batch_tokens'])} (micro-batch {b['micro_batch_size']} x {m['seq_len']:,}, "
                   f"{b['grad_accum']} accumulation)"),
        ("learning rate", f"{r['learning_rate']:.3g} peak, {s['warmup_steps']} warmup steps, {s['lr_schedule']} to "
                          f"{fmt.percent(s['min_lr_ratio'])}"),
        ("rule", f"DeepSeek LLM at C = {fmt.sci(r['compute'])}: eta {r['learning_rate']:.3g}, batch "
                 f"{fmt.exact(round(r['batch_tokens']))} tokens (in whole sequences per GPU: "
                 f"{fmt.exact(b['global_batch_tokens'])})"),
        ("memory", f"{b['rung']}, micro-batch {b['micro_batch_size']} (the memory model fits up to "
                   f"{fmt.exact(b['max_micro_batch'])}): {fmt.size(b['peak_memory_bytes'])} at the peak"
                   + (" per GPU" if d["gpu"] != CPU else "")),
        ("dataset", f"reads {fmt.count(data['train_tokens_needed'])} of its {fmt.count(data['train_split_tokens'])} "
                    f"train tokens: {data['epochs']:.2f} epochs (at most {data['max_epochs']:g})"),
        ("evaluation", f"every {c['eval_interval']} steps on {fmt.exact(c['eval_tokens'])} val tokens: "
                       f"{c['evaluations']} evaluations, {fmt.percent(c['eval_share'])} of the time"),
        ("checkpoints", f"every {c['checkpoint_interval']} steps: {lost}"),
        ("predicted speed", f"{fmt.count(pred['tokens_per_s'])} tokens/s, {pred['step_s']:.3g} s a step"),
        ("predicted time", f"{fmt.duration(pred['total_s'])} (" + ", ".join(
            f"{name} {fmt.duration(seconds[key])}" for key, name in PHASE_NAMES) + ")"),
        ("predicted cost", fmt.money(pred["cost_usd"]) if pred["cost_usd"] is not None
         else "- (your own machine: --price-per-hour prices it)"),
    ]


def _tflops(d: dict[str, Any]) -> str:
    each = d["peak_tflops"]
    peak = f"{each:.1f} TFLOP/s" if each >= 1 else f"{each * 1000:.1f} GFLOP/s"
    return peak if d["num_gpus"] == 1 else f"{d['num_gpus']} x {peak}"


def correct_after_preflight(run: Any, world_size: int) -> dict[str, Any] | None:
    """For a run `nanopt plan` wrote: its plan corrected from the preflight just saved (nanopt.plan.recipe.correct)
    and written when it changes anything, as JSON-ready facts for --json; None for a run nobody planned. A plan
    that cannot be corrected (the run started, the budget too small at the measured rate) is a warning."""
    from nanopt.errors import ConfigError
    from nanopt.plan.recipe.correct import correct_plan, write_correction

    try:
        correction = correct_plan(run, world_size)
        if correction is None:
            return None
        if correction.changes:
            correction = write_correction(correction)
    except ConfigError as exc:
        return {"corrected": False, "warning": exc.message, "hint": exc.hint}
    return {"corrected": correction.written, "why": correction.why,
            "changes": [{"key": key, "planned": old, "corrected": new} for key, old, new in correction.changes],
            "predicted_total_s": {"planned": correction.before["total_s"], "corrected": correction.after["total_s"]},
            "predicted_cost_usd": {"planned": correction.before["cost_usd"], "corrected": correction.after["cost_usd"]}}


def render_correction(c: dict[str, Any], run: Path) -> None:
    out = console()
    if "warning" in c:
        out.print(f"[bold yellow]warning:[/] the plan is not corrected: {escape(c['warning'])}", soft_wrap=True)
        if c.get("hint"):
            out.print(f"  hint: {escape(c['hint'])}", soft_wrap=True)
        return
    out.print(f"[bold]the plan, corrected from this measurement:[/] {escape(c['why'])}", soft_wrap=True)
    if not c["changes"]:
        return
    table = Table(title=None)
    for name in ("train.json", "planned", "corrected"):
        table.add_column(name, justify="left" if name == "train.json" else "right")
    for change in c["changes"]:
        table.add_row(change["key"], *(_value(change[side]) for side in ("planned", "corrected")))
    total = c["predicted_total_s"]
    table.add_row("predicted time", fmt.duration(total["planned"]), fmt.duration(total["corrected"]))
    out.print(table)
    out.print(escape(f"wrote {run / 'train.json'} and plan.json (\"corrected\"): `nanopt train "
                     f"{shell_word(run)}` trains the corrected plan"), soft_wrap=True)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return fmt.exact(value) if isinstance(value, int) else escape(str(value))
