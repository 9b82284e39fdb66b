"""`nanopt export`: a checkpoint as a Hugging Face transformers directory (model, config and tokenizer)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import app, console, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.helptext import epilog
from nanopt.rundir import RunDir

ABOUT = """
The model is rebuilt from the checkpoint's own config snapshot; the tokenizer is the tokenizer.json the checkpoint
carries, so no dataset is needed (checkpoints written before they carried one: the run's dataset, or --data, which
must use the same tokenizer). llama runs become LlamaForCausalLM, gpt2 runs GPT2LMHeadModel, with fp32 weights.
Files and directories get the permissions a plain mkdir / open gives them (the umask), so others can read them.
"""

EXAMPLES = """
nanopt train runs/demo                                    # the run: checkpoints at steps 800 and 1200
nanopt export runs/demo                                   # writes runs/demo/export
nanopt export runs/demo --checkpoint runs/demo/checkpoints/step-000800 --out /tmp/demo-800 --json
nanopt export runs/gpt2-small --checkpoint best --out exports/gpt2-small --force   # replaces an earlier export
"""


@app.command("export", epilog=epilog(ABOUT, EXAMPLES))
def export_command(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run directory with checkpoints."),
    out: Path | None = typer.Option(None, "--out", "-o", metavar="DIR", help="Directory to write (default: "
                                    "RUN/export)."),
    checkpoint: str = typer.Option("latest", "--checkpoint", metavar="CHECKPOINT", help="latest, best, or a "
                                   "checkpoint directory."),
    data: Path | None = typer.Option(None, "--data", metavar="DIR", help="Only for checkpoints that do not carry "
                                     "their tokenizer (older ones): take it from this dataset directory, made with "
                                     "the run's tokenizer."),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace an earlier export at --out (never "
                               "anything else)."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print what was written as JSON."),
) -> None:
    """Export a checkpoint to a transformers directory that AutoModelForCausalLM and AutoTokenizer load."""
    from nanopt.evaluate.trained import open_trained, refuse_fallback
    from nanopt.export.hf import export_hf
    from nanopt.train.checkpoint import load_model_state

    trained = open_trained(run_dir, checkpoint, data, for_loss=False)
    refuse_fallback(trained)  # shipping older weights than `latest` is never done unasked
    written = export_hf(trained.run.model, load_model_state(trained.checkpoint), trained.tokenizer_path,
                        out if out is not None else RunDir(run_dir).export_dir, eos_id=trained.eos_id,
                        force=force, run_dir=run_dir)
    files = {p.name: p.stat().st_size for p in sorted(written.iterdir()) if p.is_file()}
    if as_json:
        print_json({"out": str(written), "checkpoint": str(trained.checkpoint.path), "step": trained.checkpoint.step,
                    "architecture": trained.run.model.architecture, "files": files})
        return
    _render(written, trained.checkpoint.path, files)


def _render(written: Path, checkpoint: Path, files: dict[str, int]) -> None:
    out = console()
    table = Table(title=escape(f"nanopt export: {written}"), caption=escape(f"from {checkpoint}"),
                  title_justify="left", caption_justify="left")
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in files.items():
        table.add_row(escape(name), fmt.size(size))
    out.print(table)
    out.print("Load it with transformers:\n")
    out.print(escape(_snippet(written)), soft_wrap=True)


def _snippet(directory: Path) -> str:
    return (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(directory)!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({str(directory)!r})")
