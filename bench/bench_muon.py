"""Muon against AdamW on the demo shape, each at its best learning rate: tokens Muon needs to reach AdamW's final loss.

    OMP_NUM_THREADS=1 python bench/bench_muon.py --out /tmp/muon-sweep
    # the full bench: runs/demo's 1,200 steps (2.46M tokens) a run, 6 to 10 runs, 4 to 11 min each on 2 shared cores
    OMP_NUM_THREADS=1 python bench/bench_muon.py --out /tmp/muon-sweep   # again after a cut-off: skips recorded runs
    python bench/bench_muon.py --out /tmp/muon-sweep --report   # the summary of what is recorded, training nothing
    python bench/bench_muon.py --out /tmp/smoke --steps 4 --eval-interval 2 --eval-tokens 2048 \\
        --adamw-lrs 3e-3 --muon-lrs 0.02 --max-extra 0    # smoke

On a CPU shared with other jobs, one thread (OMP_NUM_THREADS=1) trained this tiny model about 7x faster than two
(0.5-0.7 s a step against 3.5 s at a load average of 7-9 on 2 cores): two threads wait at every barrier for a core.
Each record notes its thread count.

Each run trains runs/demo's model (model.json as is) on the built-in corpus (`--data`, made by `nanopt tokenize`)
with runs/demo's train.json: `--steps` optimizer steps of 2,048 tokens (default the demo's 1,200), warm-up scaled
with them (the demo's 50 at 1,200), cosine to 10%, evaluated every `--eval-interval` steps on the same
`--eval-tokens` validation tokens. Every run has the same seed, so the same batches in the same order.

The sweep: AdamW's `learning_rate` over `--adamw-lrs`; Muon's `muon_learning_rate` over `--muon-lrs`, with the
demo's AdamW learning rate (0.003) on the embeddings, head and norms. A learning rate is best when its final
validation loss is lowest; when the best is the lowest or highest of its sweep, the next point beyond that edge
(the edge times the spacing of the two nearest points) is added, up to `--max-extra` times per optimizer, so the
reported best sits inside its sweep. The order: each optimizer's default first (a comparison early), then AdamW's
whole sweep, then Muon's: AdamW's best is the target every figure is measured against, so it is the one that must be
certified when a sweep is cut off; a Muon run short of Muon's best learning rate can only understate Muon.

Each finished run is appended at once as one JSON line to OUT/results.jsonl (optimizer, learning rates, final
validation loss, the validation curve, tokens, wall time, commit): a cut-off sweep keeps what it measured, and a
rerun with the same OUT and settings skips what is recorded. The summary, printed last as one JSON line: each
optimizer's best learning rate and whether it is inside its sweep; the target, the best AdamW run's final
validation loss; the tokens at which each best run first reaches it (linear between the evaluations around the
crossing; null if never); `ratio` = AdamW's tokens over Muon's (above 1: Muon needs fewer tokens); and `complete`,
false while a sweep's best is at an edge or a planned run is missing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "runs" / "demo"
LR_KEY = {"adamw": "learning_rate", "muon": "muon_learning_rate"}


def demo_train() -> dict:
    return {key: value for key, value in json.loads((DEMO / "train.json").read_text()).items()
            if not key.startswith("_")}


def settings_of(args: argparse.Namespace) -> dict:
    """What must match for a recorded run to stand in for one of this sweep."""
    demo = demo_train()
    warmup = max(1, round(demo["warmup_steps"] * args.steps / demo["max_steps"]))
    return {"steps": args.steps, "warmup_steps": warmup, "eval_interval": args.eval_interval,
            "eval_tokens": args.eval_tokens, "data": str(args.data.resolve()), "seed": demo["seed"]}


def make_run(root: Path, name: str, settings: dict, **optimizer: object) -> Path:
    train = demo_train()
    train.update(data=settings["data"], max_steps=settings["steps"], warmup_steps=settings["warmup_steps"],
                 eval_interval=settings["eval_interval"], eval_tokens=settings["eval_tokens"],
                 checkpoint_interval=0, keep_checkpoints=1, log_interval=10, **optimizer)
    run = root / "runs" / name
    if run.exists():  # a run cut off before it was recorded starts again from nothing
        shutil.rmtree(run)
    run.mkdir(parents=True)
    (run / "model.json").write_text((DEMO / "model.json").read_text())
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


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_one(out: Path, optimizer: str, lr: float, settings: dict, adamw_lr: float) -> dict:
    started = time.perf_counter()
    lrs = {"learning_rate": lr} if optimizer == "adamw" else {"learning_rate": adamw_lr, "muon_learning_rate": lr}
    curve = train(make_run(out, f"{optimizer}-{lr:g}", settings, optimizer=optimizer, **lrs))
    record = {"bench": "muon", "optimizer": optimizer, "lr": lr, **lrs, "final_val_loss": curve[-1][1],
              "tokens": curve[-1][0], "curve": curve, "wall_s": round(time.perf_counter() - started, 1),
              "commit": commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "settings": settings}
    with (out / "results.jsonl").open("a") as results:  # at once: a cut-off sweep keeps every finished run
        results.write(json.dumps(record) + "\n")
    return record


def recorded(out: Path, settings: dict) -> dict[str, dict[float, dict]]:
    """The runs OUT/results.jsonl holds for these settings, by optimizer and learning rate."""
    runs: dict[str, dict[float, dict]] = {"adamw": {}, "muon": {}}
    path = out / "results.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record.get("bench") == "muon" and record.get("settings") == settings:
            runs[record["optimizer"]][record["lr"]] = record
    return runs


def best(runs: dict[float, dict]) -> float | None:
    return min(runs, key=lambda lr: runs[lr]["final_val_loss"]) if runs else None


def beyond_edge(runs: dict[float, dict]) -> float | None:
    """The next learning rate past the sweep's edge when the best run sits there; None when it is inside."""
    lrs = sorted(runs)
    if len(lrs) < 2:
        return None
    lr = best(runs)
    if lr == lrs[0]:
        return lrs[0] * lrs[0] / lrs[1]
    if lr == lrs[-1]:
        return lrs[-1] * lrs[-1] / lrs[-2]
    return None


def middle_first(lrs: list[float]) -> list[float]:
    """A sweep's starting learning rates, its middle (the default) first, then outwards, lower before higher."""
    ordered = sorted(lrs)
    return sorted(ordered, key=lambda lr: abs(ordered.index(lr) - (len(ordered) - 1) / 2))


def sweep(out: Path, start: dict[str, list[float]], settings: dict, args: argparse.Namespace) -> None:
    """Each optimizer's default first, then AdamW's whole sweep, then Muon's (see the module's docstring)."""
    runs = recorded(out, settings)

    def ensure(optimizer: str, lr: float) -> None:
        if lr not in runs[optimizer]:
            runs[optimizer][lr] = announce(run_one(out, optimizer, lr, settings, args.adamw_lr))

    for optimizer, lrs in start.items():
        ensure(optimizer, middle_first(lrs)[0])
    for optimizer, lrs in start.items():
        for lr in middle_first(lrs):
            ensure(optimizer, lr)
        while (beyond_edge(runs[optimizer]) is not None
               and sum(lr not in lrs for lr in runs[optimizer]) < args.max_extra):
            ensure(optimizer, beyond_edge(runs[optimizer]))


def announce(record: dict) -> dict:
    print(f"{record['optimizer']:5s} {LR_KEY[record['optimizer']]}={record['lr']:g}: final val loss "
          f"{record['final_val_loss']:.4f} after {record['tokens']:,} tokens ({record['wall_s']:.0f} s)", flush=True)
    return record


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


def summary(out: Path, start: dict[str, list[float]], settings: dict, args: argparse.Namespace) -> dict:
    runs = recorded(out, settings)
    report: dict = {"bench": "muon", "settings": settings, "results": str(out / "results.jsonl")}
    complete = True
    for opt in runs:
        lr = best(runs[opt])
        inside = lr is not None and beyond_edge(runs[opt]) is None and len(runs[opt]) >= 3
        complete &= inside and all(x in runs[opt] for x in start[opt])
        report[opt] = {"best_lr": lr, "best_inside_sweep": inside,
                       "final_val_loss": {f"{x:g}": runs[opt][x]["final_val_loss"] for x in sorted(runs[opt])}}
    if runs["adamw"] and runs["muon"]:
        adamw, muon = runs["adamw"][best(runs["adamw"])], runs["muon"][best(runs["muon"])]
        target = adamw["final_val_loss"]
        report["target_val_loss"] = target
        report["adamw"]["tokens_to_target"] = adamw_tokens = tokens_to_reach(adamw["curve"], target)
        report["muon"]["tokens_to_target"] = muon_tokens = tokens_to_reach(muon["curve"], target)
        report["ratio"] = adamw_tokens / muon_tokens if adamw_tokens and muon_tokens else None
    report["complete"] = complete
    report["command"] = " ".join(["python", "bench/bench_muon.py", *sys.argv[1:]])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo = demo_train()
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs and results.jsonl")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "stdlib", help="dataset directory")
    parser.add_argument("--steps", type=int, default=demo["max_steps"], help="optimizer steps per run")
    parser.add_argument("--eval-interval", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--eval-tokens", type=int, default=32768, help="validation tokens per evaluation")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--adamw-lr", type=float, default=demo["learning_rate"],
                        help="Muon runs: AdamW's learning rate on the embeddings, head and norms")
    parser.add_argument("--max-extra", type=int, default=2,
                        help="learning rates each sweep may add past an edge where its best sits")
    parser.add_argument("--report", action="store_true", help="summarize OUT/results.jsonl, training nothing")
    args = parser.parse_args()
    if min(args.steps, args.eval_interval, args.eval_tokens) < 1 or args.max_extra < 0:
        parser.error("--steps, --eval-interval and --eval-tokens must be positive, --max-extra not negative")
    if not (args.data / "meta.json").is_file():
        parser.error(f"no dataset at {args.data}: make it with `nanopt tokenize --out {args.data}`")

    settings = settings_of(args)
    start = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        sweep(args.out, start, settings, args)
    print(json.dumps(summary(args.out, start, settings, args)))


if __name__ == "__main__":
    main()
