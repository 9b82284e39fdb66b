"""The training loader's time per optimizer step on a 3-source mixture, against one dataset: the ratio.

    python bench/bench_mixture_loader.py                          # about a minute on 2 CPU cores
    python bench/bench_mixture_loader.py --data data/stdlib --steps 200 --rounds 7

The dataset (--data, else the built-in corpus tokenized into a temporary directory) is copied twice, so the
mixture reads three dataset directories of the same size, each through its own memory maps, at weights 0.5 / 0.3 /
0.2. Both loaders hand out the same number of micro-batches of the same shape: the single-dataset TrainLoader
(nanopt.data.loaders.loader) and the MixtureLoader (nanopt.data.mixtures.mixture), each doing all its per-step work (the
token-id check of the step's samples, the window lookup, the reads and the tensors) in the calling thread, as training
on the CPU does. Time is this process's CPU time (the loaders run in this thread alone), so other processes on a shared
machine do not count; within a round the two loaders alternate every 10 steps, each going on where it stopped. The
figure is the median over rounds of mixture time / single time (1.00: as fast). Prints one line per round, then one
JSON line with everything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WEIGHTS = (0.5, 0.3, 0.2)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="a dataset directory (default: the built-in corpus, tokenized)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per round and loader")
    parser.add_argument("--rounds", type=int, default=7)
    return parser.parse_args()


def sources(root: Path, data: Path | None) -> list[Path]:
    from nanopt.data.tokenize.pipeline import build_dataset

    first = root / "web"
    if data is None:
        build_dataset(first)  # the built-in corpus
    else:
        shutil.copytree(data, first)
    for name in ("code", "math"):
        shutil.copytree(first, root / name)
    return [first, root / "code", root / "math"]


def loaders(paths: list[Path], args: argparse.Namespace) -> tuple[object, object]:
    from nanopt.config.mixture import Mixture, MixturePhase, MixtureSource
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loaders.loader import TrainLoader
    from nanopt.data.mixtures.mixture import MixtureData, MixtureLoader

    layout = (args.seq_len, args.micro_batch_size, args.grad_accum, 0, 1, 1337)
    single = TrainLoader(TokenDataset.open(paths[0]), "train", *layout)
    mixture = Mixture(tuple(MixtureSource(p.name, str(p), w) for p, w in zip(paths, WEIGHTS, strict=True)),
                      (MixturePhase(0, WEIGHTS, "data"),))
    mixed = MixtureLoader(MixtureData(mixture, [TokenDataset.open(p) for p in paths]), "train", *layout)
    return single, mixed


def timed(loader: object, steps: int) -> float:
    started = time.process_time()
    for _ in range(steps * loader.grad_accum):
        loader.next_batch()
    return time.process_time() - started


def alternating(single: object, mixed: object, steps: int) -> tuple[float, float]:
    one = three = 0.0
    for _ in range(0, steps, 10):
        one += timed(single, 10)
        three += timed(mixed, 10)
    return one, three


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = sources(Path(tmp), args.data)
        single, mixed = loaders(paths, args)
        timed(single, 5), timed(mixed, 5)  # first reads of the pages and the permutations
        rounds = []
        for number in range(args.rounds):
            one, three = alternating(single, mixed, args.steps)
            rounds.append({"single_s_per_step": one / args.steps, "mixture_s_per_step": three / args.steps,
                           "ratio": three / one})
            print(f"round {number + 1}: single {1e3 * one / args.steps:.3f} ms/step, mixture "
                  f"{1e3 * three / args.steps:.3f} ms/step, ratio {three / one:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(json.dumps({"bench": "mixture_loader", "sources": 3, "weights": WEIGHTS, "seq_len": args.seq_len,
                      "micro_batch_size": args.micro_batch_size, "grad_accum": args.grad_accum,
                      "steps": args.steps, "rounds": rounds, "median_ratio": ratio}))


if __name__ == "__main__":
    main()
