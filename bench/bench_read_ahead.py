"""The host's time in the loader after a training step's sync, with and without the step planning its next read.

    python bench/bench_read_ahead.py                       # GPT-2's shape: 32 x 1024, about half a minute
    python bench/bench_read_ahead.py --data data/stdlib --micro-batch-size 8 --seq-len 2048

On a GPU the step has one host sync, before the optimizer (nanopt/train/step.py). From then until the next forward
is launched, the device has nothing queued, so every millisecond the host spends there is a millisecond of idle
GPU. The first window on an H100 measured 11% idle at GPT-2's shape, and 1.8 ms per step inside `next_batch`. Most
of that was the loader's own planning: the next batch's windows (the Feistel permutation) and the token-id check
of the next step. `TrainLoader.plan_ahead()` now does that planning before the sync, while the device still has the
backward queued. This script times both orders on one reading-ahead loader (no pinning: the CPU has no GPU), with
a sleep standing in for the launches. The figure is the host's milliseconds per step inside `next_batch`, which
sits on the idle path. `plan_ahead` is timed too: it moved before the sync, and no work was removed. One JSON line
at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="a dataset directory (default: the built-in corpus, tokenized)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100, help="steps per round and order")
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def per_step_ms(dataset: object, args: argparse.Namespace, plan: bool) -> tuple[float, float]:
    """(ms in next_batch, ms in plan_ahead) per step, one micro-batch a step."""
    from nanopt.data.loaders.loader import TrainLoader

    loader = TrainLoader(dataset, "train", args.seq_len, args.micro_batch_size, 1, 0, 1, 1337)
    loader.prefetch()
    waited = planned = 0.0
    for step in range(args.steps + 5):  # the first 5 read the pages and the permutation in
        started = time.perf_counter()
        loader.next_batch()
        took = time.perf_counter() - started
        time.sleep(0.005)  # forward and backward being launched
        started = time.perf_counter()
        if plan:
            loader.plan_ahead()
        spent = time.perf_counter() - started
        time.sleep(0.005)  # the sync: the device finishes the backward
        if step >= 5:
            waited, planned = waited + took, planned + spent
    loader.close()
    return 1e3 * waited / args.steps, 1e3 * planned / args.steps


def main() -> None:
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.tokenize.pipeline import build_dataset

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = Path(tmp) / "stdlib"
            build_dataset(path)  # the built-in corpus
        dataset = TokenDataset.open(path)
        rounds = []
        for number in range(args.rounds):
            before, _ = per_step_ms(dataset, args, plan=False)
            after, planning = per_step_ms(dataset, args, plan=True)
            rounds.append({"next_batch_ms_before": before, "next_batch_ms_after": after, "plan_ahead_ms": planning})
            print(f"round {number + 1}: after the sync, next_batch {before:.3f} ms/step before, {after:.3f} after "
                  f"(plan_ahead {planning:.3f} ms, before the sync)", flush=True)
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(json.dumps({"bench": "read_ahead", "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
                      "steps": args.steps, "rounds": rounds, "median": median}))


if __name__ == "__main__":
    main()
