"""Muon's optimizer step alone: torch.optim.Muon's own step against nanopt's, batched by shape.

    python bench/bench_muon_step.py                        # GPT-2 small's 48 block matrices, CUDA if present
    python bench/bench_muon_step.py --shape 2048x2048:64 --shape 8192x2048:32 --shape 2048x8192:16  # the 1B

torch's step orthogonalizes one matrix at a time, about 25 kernel launches each; nanopt.train.optim.muon_step runs the
matrices of one shape as one batch. Both steps do the same arithmetic with the same precision (the suite checks that
the weights agree bit for bit on the CPU). On the second GPU window (an H200), Muon trained GPT-2 small at 0.73x
AdamW's tokens/s with torch's step. The figure here is the ratio of the two steps' times, measured in alternating
rounds on one set of weights and gradients. On a CPU the arithmetic dominates and the ratio stays near 1; what the
batching saves is launches, and those cost their time on a GPU. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# GPT-2 small's matrices inside its 12 blocks (nanopt's layout: fused qkv, output, MLP up and down).
GPT2_SMALL = ("2304x768:12", "768x768:12", "3072x768:12", "768x3072:12")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help="ROWSxCOLS:COUNT, repeatable (default: GPT-2 small's)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return parser.parse_args()


def matrices(specs: list[str], device: object) -> list[object]:
    import torch

    params = []
    for spec in specs:
        dims, _, count = spec.partition(":")
        rows, cols = (int(d) for d in dims.split("x"))
        for _ in range(int(count or 1)):
            param = torch.nn.Parameter(torch.randn(rows, cols, device=device) * 0.02)
            param.grad = torch.randn(rows, cols, device=device)
            params.append(param)
    return params


def timed(step: object, steps: int, device: object) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def measure(shapes: list[str], steps: int, rounds: int, device_name: str | None = None) -> dict[str, Any]:
    """Both steps on one set of matrices (`shapes`), alternating, best of `rounds` rounds of `steps` steps each."""
    import torch

    from nanopt.train.optim.muon_step import batched_muon_step

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    params = matrices(shapes, device)
    muon = torch.optim.Muon(params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
    sides = {"torch": muon.step, "batched": lambda: batched_muon_step(muon)}
    for step in sides.values():
        timed(step, 2, device)  # warm-up: momentum buffers, cuBLAS handles and workspaces
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, step in sides.items():
            times[name].append(timed(step, steps, device))
    best = {name: min(values) for name, values in times.items()}
    ratios = [t / b for t, b in zip(times["torch"], times["batched"], strict=True)]
    return {"device": str(device), "torch": torch.__version__, "matrices": len(params), "shapes": shapes,
            "steps": steps, "rounds": rounds, "torch_step_ms": round(best["torch"] * 1e3, 3),
            "batched_step_ms": round(best["batched"] * 1e3, 3), "speedup": round(best["torch"] / best["batched"], 3),
            "speedup_rounds": [round(r, 3) for r in ratios], "median_speedup": round(statistics.median(ratios), 3)}


def main() -> None:
    args = parse_args()
    result = measure(args.shape or list(GPT2_SMALL), args.steps, args.rounds, args.device)
    for name in ("torch", "batched"):
        print(f"{name:8s} step {result[f'{name}_step_ms']:8.2f} ms (best of {args.rounds} rounds of {args.steps})")
    print(json.dumps({"bench": "muon_step", **result}))

if __name__ == "__main__":
    main()
