"""Benchmark `nanopt tokenize`: throughput against the tokenizers library itself, and peak memory against corpus size.

Throughput, over the same in-memory documents (the built-in corpus) and the same trained BPE (the built-in default):
  (a) a plain single-core loop of `Tokenizer.encode`,
  (b) the library's own `encode_batch` (one call over every document, and in batches of the pipeline's size;
      the faster of the two is the reference), and `encode_batch_fast` for context,
  (c) nanopt's pipeline from an in-memory source: splitting, encoding, writing shards, statistics.
Target: (c) >= 0.9 x (b). Ratios are medians over rounds of each round's ratio (methods interleaved), so they hold
up on a machine shared with other jobs; the tokens/s columns are each method's best round.

Peak memory: a fresh subprocess per configuration runs the real pipeline on the built-in corpus repeated 1x and 5x
and reports its own peak RSS (VmHWM). Target: 5x within 20% of 1x, i.e. memory does not grow with the corpus.

    python bench/bench_tokenize.py            # about two minutes on 2 cores
    python bench/bench_tokenize.py --json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPEATS = (1, 5)


def stdlib_documents() -> list[str]:
    from nanopt.data.corpus.sources import StdlibSource

    return [t for t in StdlibSource().texts() if t and not t.isspace()]


def train_tokenizer(docs: list[str], path: Path) -> Any:
    """The BPE `nanopt tokenize` trains for the built-in corpus by default (same vocabulary size)."""
    from nanopt.data.tokenize.settings import BUILTIN_VOCAB_SIZE
    from nanopt.data.tokenizers.tokenizer import save_tokenizer, train_bpe

    named = train_bpe(docs, BUILTIN_VOCAB_SIZE)
    save_tokenizer(named, path)
    return named.tokenizer


def timed_rounds(methods: dict[str, Callable[[], int]], rounds: int) -> tuple[dict[str, list[float]],
                                                                             dict[str, list[float]]]:
    """Tokens per wall-clock second and per CPU second (all threads) of each method, round by round, the methods
    interleaved within a round so that each round's figures share the machine's load of that moment."""
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens = method()
            wall[name].append(tokens / (time.perf_counter() - start))
            cpu[name].append(tokens / max(time.process_time() - start_cpu, 1e-9))
    return wall, cpu


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of the per-round ratio: robust to other jobs on a shared machine, which only slow a run
    down and change from minute to minute (the best round of each method may come from different moments)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def chunks(docs: list[str], size: int) -> Iterator[list[str]]:
    for i in range(0, len(docs), size):
        yield docs[i:i + size]


def throughput(docs: list[str], tokenizer: Any, tokenizer_path: Path, batch_size: int,
               rounds: int) -> dict[str, Any]:
    from nanopt.data.corpus.sources import TextListSource
    from nanopt.data.tokenize.pipeline import build_dataset

    def pipeline() -> int:
        with tempfile.TemporaryDirectory() as tmp:
            summary = build_dataset(Path(tmp) / "ds", TextListSource(docs), tokenizer=str(tokenizer_path),
                                    batch_size=batch_size)
        return summary["tokens"] - summary["documents"]  # the EOS separators are not encoder output

    methods = {
        "single_core_encode": lambda: sum(len(tokenizer.encode(d, add_special_tokens=False).ids) for d in docs),
        "encode_batch_one_call": lambda: sum(len(e.ids) for e in tokenizer.encode_batch(docs,
                                                                                      add_special_tokens=False)),
        "encode_batch_batched": lambda: sum(len(e.ids) for c in chunks(docs, batch_size)
                                            for e in tokenizer.encode_batch(c, add_special_tokens=False)),
        "encode_batch_fast_batched": lambda: sum(len(e.ids) for c in chunks(docs, batch_size)
                                                 for e in tokenizer.encode_batch_fast(c, add_special_tokens=False)),
        "nanopt_pipeline": pipeline,
    }
    tokens = methods["encode_batch_batched"]()  # also starts the thread pool outside the timings
    wall, cpu = timed_rounds(methods, rounds)
    reference = [max(pair) for pair in zip(wall["encode_batch_one_call"], wall["encode_batch_batched"], strict=True)]
    return {"documents": len(docs), "tokens": tokens, "batch_size": batch_size, "rounds": rounds,
            "tokens_per_second": {name: max(values) for name, values in wall.items()},
            "tokens_per_cpu_second": {name: max(values) for name, values in cpu.items()},
            "ratio_vs_single_core": paired_ratio(wall["nanopt_pipeline"], wall["single_core_encode"]),
            "ratio_vs_encode_batch": paired_ratio(wall["nanopt_pipeline"], reference),
            "ratio_vs_encode_batch_fast": paired_ratio(wall["nanopt_pipeline"], wall["encode_batch_fast_batched"])}


class RepeatedStdlib:
    """The built-in corpus, `times` times over: a corpus that grows while everything else stays the same."""

    kind = "builtin"

    def __init__(self, times: int) -> None:
        from nanopt.data.corpus.sources import StdlibSource

        self.inner, self.times = StdlibSource(), times

    def texts(self) -> Iterator[str]:
        for _ in range(self.times):
            yield from self.inner.texts()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "repeated": self.times}

    def size_hint(self) -> Any:
        from nanopt.data.corpus.sources import SizeHint

        hint = self.inner.size_hint()
        return SizeHint(bytes=hint.bytes * self.times, documents=hint.documents * self.times)


def child(times: int, tokenizer: str | None, out: str, batch_size: int) -> None:
    """Run inside a fresh process: build the dataset, print tokens, time and this process's peak RSS."""
    from nanopt.data.tokenize.pipeline import build_dataset

    start = time.perf_counter()
    summary = build_dataset(out, RepeatedStdlib(times), tokenizer=tokenizer, batch_size=batch_size)
    print(json.dumps({"tokens": summary["tokens"], "seconds": time.perf_counter() - start, "peak_rss": peak_rss()}))


def peak_rss() -> int:
    """This process's peak resident memory in bytes. Linux: VmHWM, which starts afresh at exec; getrusage's
    ru_maxrss would also count the parent's memory at fork time."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def memory(tokenizer_path: Path, batch_size: int, repeats: int) -> dict[str, Any]:
    """Peak RSS per configuration: the largest of `repeats` fresh processes, since one run's peak depends on which
    large documents happen to be in flight together."""
    results: dict[str, Any] = {}
    for mode, tokenizer in (("given_tokenizer", str(tokenizer_path)), ("training_tokenizer", "")):
        for times in REPEATS:
            runs = [_child_run(times, tokenizer, batch_size) for _ in range(repeats)]
            results[f"{mode}_{times}x"] = max(runs, key=lambda run: run["peak_rss"])
        first, last = (results[f"{mode}_{t}x"]["peak_rss"] for t in (REPEATS[0], REPEATS[-1]))
        results[f"{mode}_growth"] = last / first
    return results


def _child_run(times: int, tokenizer: str, batch_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, __file__, "--child", str(times), "--tokenizer", tokenizer,
                   "--out", str(Path(tmp) / "ds"), "--batch-size", str(batch_size)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=120)
    t = result["throughput"]
    table = Table(title=f"tokens/s over the built-in corpus ({t['documents']} documents, {t['tokens']:,} tokens, "
                        f"batches of {t['batch_size']}, best of {t['rounds']} rounds)", title_justify="left",
                  caption="ratios: median over rounds of each round's ratio", caption_justify="left")
    table.add_column("method")
    table.add_column("tokens/s", justify="right")
    table.add_column("tokens per CPU-second", justify="right")
    for name, value in t["tokens_per_second"].items():
        table.add_row(name.replace("_", " "), f"{value:,.0f}", f"{t['tokens_per_cpu_second'][name]:,.0f}")
    out.print(table)
    out.print(f"nanopt / single-core encode loop: {t['ratio_vs_single_core']:.2f}x")
    out.print(f"nanopt / encode_batch (best of one call and batched): {t['ratio_vs_encode_batch']:.2f}x "
              f"(target >= 0.9)")
    out.print(f"nanopt / encode_batch_fast (batched): {t['ratio_vs_encode_batch_fast']:.2f}x")
    m = result["memory"]
    table = Table(title="peak RSS of the pipeline (largest of the repeats), built-in corpus repeated",
                  title_justify="left")
    for name in ("mode", *(f"{r}x" for r in REPEATS), f"{REPEATS[-1]}x / {REPEATS[0]}x"):
        table.add_column(name, justify="right" if name != "mode" else "left")
    for mode in ("given_tokenizer", "training_tokenizer"):
        cells = [f"{m[f'{mode}_{r}x']['peak_rss'] / 2**20:,.0f} MiB ({m[f'{mode}_{r}x']['tokens'] / 1e6:.1f}M tok, "
                 f"{m[f'{mode}_{r}x']['seconds']:.1f}s)" for r in REPEATS]
        table.add_row(mode.replace("_", " "), *cells, f"{m[f'{mode}_growth']:.3f} (target <= 1.2)")
    out.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256, help="documents per encode call (pipeline default)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--memory-repeats", type=int, default=2, help="processes per memory configuration")
    parser.add_argument("--skip-memory", action="store_true", help="throughput only")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokenizer or None, args.out, args.batch_size)
        return
    with tempfile.TemporaryDirectory() as tmp:
        docs = stdlib_documents()
        tokenizer_path = Path(tmp) / "tokenizer.json"
        tokenizer = train_tokenizer(docs, tokenizer_path)
        result = {"throughput": throughput(docs, tokenizer, tokenizer_path, args.batch_size, args.rounds)}
        if not args.skip_memory:
            result["memory"] = memory(tokenizer_path, args.batch_size, args.memory_repeats)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result) if "memory" in result else print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
