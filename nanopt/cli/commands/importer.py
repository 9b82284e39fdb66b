"""`nanopt import`: a Hugging Face transformers checkpoint as a new run directory, ready for continued pretraining
(`nanopt train`), evaluation (`nanopt eval`) and export."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import app, console, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.helptext import epilog

ABOUT = """
SOURCE is a local directory saved by transformers' save_pretrained, or a hub name (config, tokenizer and safetensors
files are downloaded; pickle weights never are, and a pickle-only model is refused). GPT-2 and Llama-shaped models
(Llama, with Llama 3.1 / 3.2's llama3 RoPE scaling as model.json's rope_scaling; SmolLM; Qwen2 and Qwen3 without
sliding windows, as qkv_bias / qk_norm) are imported when nanopt's model computes exactly what transformers does;
anything else (another RoPE scaling, another activation, a head size other than hidden / heads, ...) is refused in
one line naming the key.

The run gets model.json, train.json (continued-pretraining defaults; set its `data`) and checkpoints/step-000000:
the weights as float32 and the tokenizer. `nanopt train` starts from those weights with a fresh optimizer at step
0. The weights are converted one tensor at a time: the import needs the interpreter and torch plus about twice the
largest tensor in memory (753 MiB for 472M parameters, bench/RESULTS.md), and the checkpoint's size (4 bytes per
parameter) on disk. A failed or interrupted import leaves no run directory.
"""

EXAMPLES = """
nanopt import HuggingFaceTB/SmolLM2-135M --run runs/smol
nanopt import openai-community/gpt2 --run runs/gpt2 --revision main
nanopt import ./my-hf-model --run runs/mine --json
"""


@app.command("import", epilog=epilog(ABOUT, EXAMPLES))
def import_command(
    source: str = typer.Argument(..., metavar="SOURCE", help="A hub name (owner/name) or a local transformers "
                                 "directory."),
    run: Path = typer.Option(..., "--run", "--out", "-o", metavar="RUN",
                             help="The run directory to create (must not exist)."),
    revision: str | None = typer.Option(None, "--revision", metavar="REVISION", help="Hub revision: a branch, tag "
                                        "or commit."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print what was imported as JSON."),
) -> None:
    """Import a transformers model into a new run directory for continued pretraining and evaluation."""
    from nanopt.importer.run import import_model

    report = import_model(source, run, revision)
    if as_json:
        print_json(dataclasses.asdict(report))
        return
    out = console()
    table = Table(title=escape(f"nanopt import: {report.run_dir}"), title_justify="left", show_header=False)
    rows = [("source", report.source + (f" @ {report.revision}" if report.revision else "")),
            ("architecture", report.architecture), ("parameters", f"{fmt.count(report.parameters)} "
                                                                   f"({report.parameters:,})"),
            ("dtype", f"{', '.join(report.source_dtypes)} -> float32"),
            ("vocabulary", f"{report.vocab_size:,} rows, tokenizer {report.tokenizer_vocab_size:,} tokens"),
            ("end of text", f"{report.eos_token} (id {report.eos_id})"),
            ("checkpoint", f"{report.checkpoint} ({fmt.size(report.checkpoint_bytes)}, step 0, weights only)")]
    for key, value in rows:
        table.add_row(key, escape(value))
    out.print(table)
    for note in report.notes:
        out.print(escape(f"note: {note}"))
    tokenizer = Path(report.checkpoint) / "tokenizer.json"
    out.print(escape(f"Next: nanopt tokenize CORPUS -o data/NAME --tokenizer {shlex.quote(str(tokenizer))}, set "
                     f"\"data\" in {shlex.quote(str(Path(report.run_dir) / 'train.json'))}, then nanopt train "
                     f"{shlex.quote(report.run_dir)}"), soft_wrap=True)
