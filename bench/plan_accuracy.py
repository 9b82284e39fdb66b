"""How honest `nanopt plan` is on this machine: for each budget, plan a run on the CPU, preflight it (which corrects
the plan to the measured rate), train it to the end with no edit, and put the measured training time and cost
beside two predictions for the run as it trained, and the rate a second preflight measures once it has ended:

- corrected: the prediction `nanopt train` wrote before its first step (RUN/prediction.json), made from the
  preflight's measurement (the issue's target: within 10%);
- uncorrected: what nanopt predicts for the same run at the rate `nanopt plan` planned it at, before any
  preflight: on a CPU the MFU the plan measured over a few steps of the planned model (target: within 15%).

Each budget's line is appended to bench/results.jsonl (with the commit and the machine's load) as soon as its run
ends, so a cut-off sweep keeps every finished one; a table at the end. The runs live in a temporary directory.

    python bench/plan_accuracy.py                                   # 2, 5 and 10 CPU-minutes: about 20 minutes
    python bench/plan_accuracy.py --budgets 40s                     # a quick check that the script works
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PRICE_PER_HOUR = 0.10  # USD per hour of this machine: the stated price the costs are computed at


def nanopt(*args: str, allowed: tuple[int, ...] = (0,)) -> float:
    """Run one `nanopt` command as a user does, in a process of its own; its wall seconds. Its errors pass
    through; an exit status not `allowed` ends the sweep."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nanopt", *args], cwd=REPO, stdout=subprocess.DEVNULL)
    if done.returncode not in allowed:
        raise SystemExit(f"nanopt {' '.join(args)}: exit status {done.returncode}")
    return time.perf_counter() - started


def uncorrected(run_dir: Path, threads: int | None) -> dict[str, Any]:
    """nanopt's prediction for the run as it trained (with `threads` torch threads) at the rate `nanopt plan`
    planned it at (the MFU it measured on this CPU with those threads; the assumed one where it did not), with no
    preflight."""
    from nanopt.config import load_run
    from nanopt.plan.estimate import DEFAULT_MFU
    from nanopt.plan.planned_rate import planned_mfu
    from nanopt.plan.prediction import Hardware, predict

    run = load_run(run_dir)
    planned = planned_mfu(run, "cpu", 1, threads)
    mfu = DEFAULT_MFU if planned is None else planned[0]
    hardware = Hardware("cpu", 1, PRICE_PER_HOUR, mfu=mfu, cpu_threads=threads)
    prediction = predict(run, hardware, "bench/plan_accuracy.py")
    prediction["throughput"]["source"] = "assumed" if planned is None else "plan-measured"
    return prediction


def one_budget(budget: str, data: Path, root: Path) -> dict[str, Any]:
    from nanopt.train.observe.metrics import read_metrics
    from nanopt.train.observe.prediction import measured, read_prediction

    run = root / f"run-{budget}"
    nanopt("plan", "--budget", budget, "--gpu", "cpu", "--data", str(data), "--out", str(run),
           "--price-per-hour", str(PRICE_PER_HOUR))
    nanopt("preflight", str(run), allowed=(0, 3))  # 3: a check failed (listed); the rate is measured either way
    wall = nanopt("train", str(run), "--no-live")
    got = measured(read_metrics(run))
    corrected = read_prediction(run)
    record = {"budget": budget, "model": shape(run), "steps": got["steps"], "command_wall_s": round(wall, 2),
              "threads": threads_used(run, corrected)}
    for name, predicted in (("corrected", corrected), ("uncorrected", uncorrected(run, record["threads"]["train"]))):
        record[name] = {"source": predicted["throughput"]["source"], "mfu": predicted["throughput"]["mfu"],
                        "tokens_per_s": predicted["tokens_per_s"],
                        "train_s": predicted["seconds"]["train"], "total_s": predicted["total_s"],
                        "cost_usd": predicted["cost_usd"],
                        "total_ratio": got["total_s"] / predicted["total_s"],
                        "cost_ratio": got["cost_usd"] / predicted["cost_usd"] if predicted["cost_usd"] else None}
    record["measured"] = {key: got[key] for key in ("tokens_per_s", "train_s", "total_s", "cost_usd")}
    # The control for a miss, the moment training has ended: near the training's rate while the preflight before it
    # was not, the machine's rate moved between the two (a shared machine's does); near the first preflight's while
    # the training was not, something in training that a preflight does not run slowed it.
    record["preflight_after"] = preflight_rate(run)
    return record


def preflight_rate(run: Path) -> dict[str, Any]:
    """`nanopt preflight` of the run as it stands, changing nothing in it but preflight.json: what it measured."""
    nanopt("preflight", str(run), "--no-correct-plan", allowed=(0, 3))
    report = json.loads((run / "preflight.json").read_text())
    return {"tokens_per_s": report["tokens_per_s"], "steps": report["steps"]["measured"],
            "threads": report["device"].get("cpu_threads", {}).get("threads")}


def threads_used(run: Path, prediction: dict[str, Any]) -> dict[str, int | None]:
    """The torch threads the plan's measurement, the preflight and the training ran with: each process chose them
    from the cores free as it started, so other work on the machine can make them differ (a measurement with other
    threads is not used for the run's prediction)."""
    from nanopt.cpu_threads import recorded_threads

    plan = json.loads((run / "plan.json").read_text()).get("throughput", {})
    preflight = json.loads((run / "preflight.json").read_text())["device"].get("cpu_threads")
    return {"plan": recorded_threads(plan.get("threads")), "preflight": recorded_threads(preflight),
            "train": prediction["device"].get("cpu_threads")}


def shape(run: Path) -> str:
    """The planned model in a few words: '4 x 64, context 512, 328,256 parameters'."""
    from nanopt.config import load_run
    from nanopt.model.flops import count_params

    model = load_run(run).model
    return (f"{model.num_hidden_layers} x {model.hidden_size}, context {model.max_position_embeddings}, "
            f"{count_params(model).total:,} parameters")


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| budget | model | steps | measured time | corrected: predicted, measured / predicted | "
             "uncorrected: predicted, measured / predicted | measured cost | tokens/s: plan, preflight, training, "
             "preflight after |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        m, c, u = r["measured"], r["corrected"], r["uncorrected"]
        after = r.get("preflight_after", {}).get("tokens_per_s")
        rates = ", ".join(f"{rate / 1000:.1f}k" if rate else "-" for rate in
                          (u["tokens_per_s"], c["tokens_per_s"], m["tokens_per_s"], after))
        lines.append(f"| {r['budget']} | {r.get('model', '?')} | {r['steps']} | {m['total_s']:.1f} s | "
                     f"{c['total_s']:.1f} s, {c['total_ratio']:.3f} | {u['total_s']:.1f} s, {u['total_ratio']:.3f} | "
                     f"${m['cost_usd']:.5f} | {rates} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", nargs="+", default=["2min", "5min", "10min"])
    parser.add_argument("--data", type=Path, default=None, help="a dataset (default: the built-in corpus, "
                        "tokenized into the temporary directory)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results.jsonl")
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        data = args.data or Path(tmp) / "stdlib"
        if args.data is None:
            nanopt("tokenize", "--out", str(data))
        for budget in args.budgets:
            record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "bench": "plan_accuracy", "commit": commit(), "machine": f"{os.cpu_count()} CPUs",
                      "load_average_before": os.getloadavg()[0], "price_per_hour": PRICE_PER_HOUR,
                      **one_budget(budget, data, Path(tmp))}
            record["load_average_after"] = os.getloadavg()[0]
            with args.results.open("a") as results:  # at once: a cut-off sweep keeps every finished budget
                results.write(json.dumps(record) + "\n")
            records.append(record)
            print(json.dumps(record), flush=True)
    print(table(records))


if __name__ == "__main__":
    main()
