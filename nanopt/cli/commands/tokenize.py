"""`nanopt tokenize`: a corpus in, a dataset directory of memory-mappable token shards out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from nanopt.cli.app import app, console, print_json
from nanopt.cli.display import format as fmt
from nanopt.cli.display.mixture import plan_table
from nanopt.cli.helptext import epilog

ABOUT = """
val and test: a document is held out for one of them by a hash of its text (5% of documents each) until the split
has --val-tokens / --test-tokens (default: the --run's eval_tokens, else 1,048,576), in source order; the rest
trains. --val-fraction / --test-fraction change the share; given alone, that share of all documents, with no limit.

--shuffle-buffer N reads the source through a buffer of N documents that emits a random one (seeded by
--shuffle-seed, default 0) for each document read: a source sorted by date or by origin no longer gives sorted
splits and training order. Memory: N documents. A document moves earlier by at most N places, so N at least the
number of documents read shuffles them all; a smaller N mixes windows of about N documents.
"""

EXAMPLES = """
nanopt tokenize --out data/stdlib          # built-in corpus (Python's standard library): offline, ~10 s
nanopt tokenize HuggingFaceFW/fineweb-edu --config sample-10BT --tokenizer gpt2 --max-tokens 2.5B --out data/fineweb-edu
nanopt tokenize HuggingFaceFW/fineweb-edu --config sample-10BT --tokenizer gpt2 --max-tokens chinchilla --run runs/gpt2-small --out data/fineweb-edu
nanopt tokenize corpus/ --vocab-size 32768 --out data/mine      # a folder of .txt / .jsonl / .parquet files
nanopt tokenize 'dump/*.parquet' --text-column content --tokenizer HuggingFaceTB/SmolLM-360M --out data/code
nanopt tokenize saved/ --split validation --tokenizer gpt2-dir/ --out data/saved   # a DatasetDict.save_to_disk directory
nanopt tokenize notes.txt --sample-by paragraph --vocab-size 2048 --out data/notes --force --json
nanopt tokenize mine.jsonl --tokenizer gpt2 --max-tokens chinchilla --run runs/gpt2-small --out data/mine   # val/test sized for the run's eval_tokens
nanopt tokenize more.jsonl --tokenizer data/mine --out data/more   # data/mine's tokenizer and end-of-text token
nanopt tokenize corpus/ --vocab-size 32768 --val-tokens 4M --test-tokens 2M --out data/big
nanopt tokenize HuggingFaceFW/fineweb-edu --config sample-10BT --sample 0.01 --sample-seed 1 --tokenizer gpt2 --max-tokens 100M --out data/fw-1pct
nanopt tokenize news-sorted-by-date.jsonl --tokenizer gpt2 --shuffle-buffer 100000 --shuffle-seed 1 --out data/news   # a sorted source, shuffled by document
"""  # noqa: E501  (whole commands stay on one line so they can be copied)

# The option panels of --help, by job.
SOURCE, TOKENIZER = "Reading the source", "Tokenizer"
SPLITS, SAMPLING, SPEED = "Splits and token budget", "Sampling and shuffling", "Shards and speed"


@app.command("tokenize", epilog=epilog(ABOUT, EXAMPLES))
def tokenize_command(
    source: str | None = typer.Argument(None, metavar="SOURCE", help="A Hugging Face dataset name, a local file, "
                                        "folder or glob (txt, json/jsonl, parquet), or a directory written by "
                                        "save_to_disk. None: the built-in corpus."),
    out: Path = typer.Option(..., "--out", "-o", metavar="DIR", help="Dataset directory to create, e.g. data/stdlib."),
    run_dir: Path | None = typer.Option(None, "--run", metavar="RUN", help="Run directory this dataset is for: its "
                                        "model sets --max-tokens chinchilla (20 tokens per parameter, rounded up to "
                                        "the run's whole global batches, plus 1: what train reads), its eval_tokens "
                                        "the default --val-tokens / --test-tokens, and val and test are checked "
                                        "against one of its evaluation windows."),
    config: str | None = typer.Option(None, "--config", metavar="NAME", rich_help_panel=SOURCE,
                                      help="Hub dataset configuration, e.g. sample-10BT."),
    split: str = typer.Option("train", "--split", metavar="NAME", rich_help_panel=SOURCE,
                              help="Split to read: of a hub dataset, or of a DatasetDict saved with save_to_disk."),
    text_column: str = typer.Option("text", "--text-column", metavar="NAME", rich_help_panel=SOURCE,
                                    help="Column holding the text (json, parquet, hub)."),
    sample_by: str = typer.Option("document", "--sample-by", metavar="document|paragraph|line",
                                  rich_help_panel=SOURCE, help="Text files: one document per file (document), per "
                                  "blank-line paragraph, or line."),
    on_decode_error: str = typer.Option("replace", "--on-decode-error", metavar="replace|refuse",
                                        rich_help_panel=SOURCE, help="Bytes that are not UTF-8 in local files: "
                                        "replace (with U+FFFD, counted in meta.json) or refuse (stop at the first, "
                                        "naming file and offset)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", metavar="TOKENIZER", rich_help_panel=TOKENIZER,
                                         help="Hugging Face tokenizer name (e.g. gpt2), a local tokenizer.json / "
                                         "directory, or a nanopt dataset (its tokenizer and end-of-text token)."),
    vocab_size: int | None = typer.Option(None, "--vocab-size", metavar="N", rich_help_panel=TOKENIZER,
                                          help="Train a byte-level BPE of this size instead (built-in corpus "
                                          "default: 1024)."),
    eos_token: str | None = typer.Option(None, "--eos-token", metavar="TOKEN", rich_help_panel=TOKENIZER,
                                         help="End-of-text token of a loaded tokenizer, when it cannot be detected."),
    tokenizer_sample_mb: int = typer.Option(64, "--tokenizer-sample-mb", metavar="MIB", rich_help_panel=TOKENIZER,
                                            help="Train the BPE on the first this many MiB of training documents."),
    max_tokens: str | None = typer.Option(None, "--max-tokens", metavar="N", rich_help_panel=SPLITS,
                                          help="Stop when train has this many tokens: 2.5B, 500M, 20e9, or "
                                          "chinchilla (with --run)."),
    val_tokens: str | None = typer.Option(None, "--val-tokens", metavar="N", rich_help_panel=SPLITS,
                                          help="Held-out documents join val until it has this many tokens (default: "
                                          "the --run's eval_tokens, else 1,048,576); e.g. 4M."),
    test_tokens: str | None = typer.Option(None, "--test-tokens", metavar="N", rich_help_panel=SPLITS,
                                           help="The same for test (what nanopt eval scores)."),
    val_fraction: float | None = typer.Option(None, "--val-fraction", metavar="FRACTION", rich_help_panel=SPLITS,
                                              help="Share of documents held out for val, above 0 (default "
                                              "0.05), up to --val-tokens; given alone: all of them, no limit."),
    test_fraction: float | None = typer.Option(None, "--test-fraction", metavar="FRACTION", rich_help_panel=SPLITS,
                                               help="The same for test."),
    sample: float | None = typer.Option(None, "--sample", metavar="FRACTION", rich_help_panel=SAMPLING,
                                        help="Keep a random share of the source's documents, e.g. 0.1: each kept "
                                        "with this probability, decided by --sample-seed and its position (a hub "
                                        "dataset too, as it streams)."),
    sample_seed: int = typer.Option(0, "--sample-seed", metavar="N", rich_help_panel=SAMPLING,
                                    help="Which documents --sample keeps: the same seed, the same subset."),
    shuffle_buffer: int | None = typer.Option(None, "--shuffle-buffer", metavar="N", rich_help_panel=SAMPLING,
                                              help="Shuffle the source by document through a buffer of this many "
                                              "documents (memory: N documents); e.g. 100000."),
    shuffle_seed: int | None = typer.Option(None, "--shuffle-seed", metavar="N", rich_help_panel=SAMPLING,
                                            help="Seed of --shuffle-buffer's order (default 0)."),
    shard_tokens: str = typer.Option("100M", "--shard-tokens", metavar="N", rich_help_panel=SPEED,
                                     help="Tokens per shard file."),
    batch_size: int = typer.Option(256, "--batch-size", metavar="N", rich_help_panel=SPEED,
                                   help="Documents per encode call, at most 1 MiB of text; each call is encoded on "
                                   "all cores."),
    threads: int | None = typer.Option(None, "--threads", metavar="N", rich_help_panel=SPEED,
                                       help="Tokenizer threads (default: every core)."),
    force: bool = typer.Option(False, "--force/--no-force", help="Replace an existing dataset at --out."),
    as_json: bool = typer.Option(False, "--json/--no-json", help="Print the summary as one JSON object."),
) -> None:
    """Tokenize a corpus into train / val / test shards of token ids, with the tokenizer and a meta.json."""
    from nanopt.data.budget import parse_token_count, resolve_max_tokens
    from nanopt.data.tokenize.pipeline import build_dataset
    from nanopt.data.tokenize.settings import refuse_empty_held_out
    from nanopt.data.tokenizers.tokenizer import set_threads

    refuse_empty_held_out(val_fraction, test_fraction)
    set_threads(threads)
    settings = dict(config=config, split=split, text_column=text_column, sample_by=sample_by, tokenizer=tokenizer,
                    vocab_size=vocab_size, eos_token=eos_token, tokenizer_sample_bytes=tokenizer_sample_mb << 20,
                    val_fraction=val_fraction, test_fraction=test_fraction,
                    val_tokens=None if val_tokens is None else parse_token_count(val_tokens, "--val-tokens"),
                    test_tokens=None if test_tokens is None else parse_token_count(test_tokens, "--test-tokens"),
                    max_tokens=resolve_max_tokens(max_tokens, run_dir, out), max_tokens_as_given=max_tokens,
                    sample=sample, sample_seed=sample_seed,
                    run=None if run_dir is None else str(run_dir),
                    shard_tokens=parse_token_count(shard_tokens, "--shard-tokens"), batch_size=batch_size,
                    on_decode_error=on_decode_error, shuffle_buffer=shuffle_buffer, shuffle_seed=shuffle_seed,
                    force=force)
    with _progress() as reporter:
        summary = build_dataset(out, source, progress=reporter, **settings)
    if run_dir is not None:  # a run on a mixture: what each source must hold, this one now made
        from nanopt.config import load_run
        from nanopt.data.mixtures.mixture_plan import plan_records

        summary["mixture_plan"] = plan_records(load_run(run_dir))
    if as_json:
        print_json(summary)
    else:
        render(summary)


def _progress():
    """A rich progress bar on stderr (nothing when stderr is not a terminal), as a pipeline ProgressReporter."""
    import rich.progress as rp

    from nanopt.data.tokenize.pipeline import ProgressReporter

    err = console(stderr=True)
    bar = rp.Progress(rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                      rp.TaskProgressColumn(), rp.TextColumn("{task.fields[rate]}"), rp.TimeElapsedColumn(),
                      rp.TextColumn("ETA"), rp.TimeRemainingColumn(), console=err, disable=not err.is_terminal)

    class RichReporter(ProgressReporter):
        def __init__(self) -> None:
            self.task: Any = None
            self.started = time.monotonic()

        def phase(self, description: str) -> None:
            if self.task is not None:
                bar.stop_task(self.task)
            self.task = bar.add_task(escape(description), total=None, rate="")  # may name a tokenizer path
            self.started = time.monotonic()

        def update(self, documents: int, tokens: int, fraction: float | None) -> None:
            elapsed = max(time.monotonic() - self.started, 1e-6)
            rate = f"{fmt.count(documents / elapsed)} docs/s"
            if tokens:
                rate += f"  {fmt.count(tokens / elapsed)} tokens/s"
            if fraction is None:
                bar.update(self.task, rate=rate)
            else:
                bar.update(self.task, total=1000, completed=round(1000 * fraction), rate=rate)

        def warn(self, message: str) -> None:
            err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)  # above the bar, one line

        def __enter__(self) -> RichReporter:
            bar.start()
            return self

        def __exit__(self, *exc: Any) -> None:
            bar.stop()

    return RichReporter()


def render(s: dict[str, Any]) -> None:
    out = console()
    table = Table(title=escape(f"nanopt tokenize: {s['out']}"), title_justify="left")
    for name in ("split", "documents", "tokens", "mean doc", "median doc", "bytes/token", "shards"):
        table.add_column(name, justify="left" if name == "split" else "right")
    for name, info in s["splits"].items():
        table.add_row(name, fmt.exact(info["documents"]), fmt.exact(info["tokens"]),
                      f"{info['mean_document_tokens']:,.1f}", f"{info['median_document_tokens']:,.1f}",
                      f"{info['bytes_per_token']:.3f}", str(info["shards"]))
    table.add_row("total", fmt.exact(s["documents"]), fmt.exact(s["tokens"]), "", "", "", "", style="bold")
    out.print(table)
    tok = s["tokenizer"]
    out.print(escape(f"tokenizer: {tok['source']} ({tok['model']}, vocab {s['vocab_size']:,}, EOS "
                     f"{tok['eos_token']!r} = id {tok['eos_id']}), shards: {s['dtype']}"))
    budget = "  (stopped at --max-tokens)" if s["stopped_at_budget"] else ""
    out.print(f"document lengths in tokens; time {fmt.duration(s['seconds'])} (tokenizing "
              f"{fmt.duration(s['tokenize_seconds'])}: {fmt.count(s['tokens_per_second'])} tokens/s, "
              f"{fmt.count(s['documents_per_second'])} docs/s); {s['empty_documents_skipped']:,} empty documents "
              f"skipped{budget}")
    for note in s["notes"]:
        out.print(f"note: {escape(note)}")
    for warning in s["warnings"]:
        out.print(f"[yellow]warning:[/] {escape(warning)}")
    if s.get("mixture_plan"):
        out.print(plan_table(s["mixture_plan"], "the --run's data mixture: what each source must hold"))
