"""Muon against AdamW on the demo shape: tokens each needs to reach the AdamW run's final validation loss.

    python bench/bench_muon.py                                   # the full bench: about 10 minutes on 2 CPU cores
    python bench/bench_muon.py --steps 4 --evals 2 --adamw-lrs 3e-3 --muon-lrs 0.02 --eval-tokens 2048   # smoke

Each optimizer trains runs/demo's model (model.json as is) on the built-in corpus (data/stdlib, made by
`nanopt tokenize`) with runs/demo's train.json, shortened to `--steps` optimizer steps (warmup a tenth of them,
cosine to 10%), once per learning rate of a small sweep: AdamW's `learning_rate`; for Muon, `muon_learning_rate`
with the demo's AdamW LR for the embeddings, head and norms. Every run has the same seed, batches and validation
tokens, and is evaluated `--evals` times. The best LR of each optimizer is the one with the lowest final
validation loss. The target is the best AdamW run's final validation loss; the tokens each best run needs to reach
it are interpolated linearly between the two evaluations around the crossing (null when a run never gets there).
`ratio` is AdamW's tokens over Muon's: above 1, Muon learns more per token. Each run is a real
`nanopt train` process; its metrics.jsonl is the source of every number. Prints one line per run, then one JSON
line with everything.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_run(root: Path, name: str, args: argparse.Namespace, **settings: object) -> Path:
    demo = REPO / "runs" / "demo"
    train = {key: value for key, value in json.loads((demo / "train.json").read_text()).items()
             if not key.startswith("_")}
    train.update(data=str((REPO / "data" / "stdlib").resolve()), max_steps=args.steps,
                 warmup_steps=max(1, args.steps // 10), eval_interval=max(1, args.steps // args.evals),
                 eval_tokens=args.eval_tokens, checkpoint_interval=0, keep_checkpoints=1, log_interval=1,
                 **settings)
    run = root / name
    run.mkdir()
    (run / "model.json").write_text((demo / "model.json").read_text())
    (run / "train.json").write_text(json.dumps(train, indent=2))
    return run


def train(run: Path) -> list[tuple[int, float]]:
    """(tokens, validation loss) of every evaluation of a real `nanopt train` run."""
    result = subprocess.run([sys.executable, "-m", "nanopt", "train", str(run), "--no-live"], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"nanopt train {run} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["tokens"], r["val_loss"]) for r in records if r.get("kind") == "eval"]


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """Tokens at which the validation loss first reaches `target`, linear between the evaluations around it."""
    previous = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(tokens)
            (t0, l0) = previous
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
        previous = (tokens, loss)
    return None


def sweep(root: Path, optimizer: str, lrs: list[float], args: argparse.Namespace) -> dict[float, list]:
    key = "learning_rate" if optimizer == "adamw" else "muon_learning_rate"
    curves = {}
    for lr in lrs:
        started = time.perf_counter()
        curves[lr] = train(make_run(root, f"{optimizer}-{lr:g}", args, optimizer=optimizer, **{key: lr}))
        print(f"{optimizer:5s} {key}={lr:g}: final val loss {curves[lr][-1][1]:.4f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48, help="optimizer steps per run (2048 tokens each)")
    parser.add_argument("--evals", type=int, default=8, help="evaluations per run")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens per evaluation")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    args = parser.parse_args()
    if args.steps < 1 or args.evals < 1 or args.eval_tokens < 1:
        parser.error("--steps, --evals and --eval-tokens must be positive")

    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        root = Path(tmp)
        adamw, muon = sweep(root, "adamw", args.adamw_lrs, args), sweep(root, "muon", args.muon_lrs, args)
    best_adamw = min(adamw, key=lambda lr: adamw[lr][-1][1])
    best_muon = min(muon, key=lambda lr: muon[lr][-1][1])
    target = adamw[best_adamw][-1][1]
    adamw_tokens = tokens_to_reach(adamw[best_adamw], target)
    muon_tokens = tokens_to_reach(muon[best_muon], target)
    print(json.dumps({
        "bench": "muon", "steps": args.steps, "tokens_per_run": adamw[best_adamw][-1][0],
        "target_val_loss": target,
        "adamw": {"best_learning_rate": best_adamw, "tokens_to_target": adamw_tokens,
                  "final_val_loss": {f"{lr:g}": c[-1][1] for lr, c in adamw.items()}},
        "muon": {"best_muon_learning_rate": best_muon, "tokens_to_target": muon_tokens,
                 "final_val_loss": {f"{lr:g}": c[-1][1] for lr, c in muon.items()}},
        "ratio": adamw_tokens / muon_tokens if adamw_tokens and muon_tokens else None,
        "command": " ".join(["python", "bench/bench_muon.py", *sys.argv[1:]])}))


if __name__ == "__main__":
    main()
