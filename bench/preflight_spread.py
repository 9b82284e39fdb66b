"""How far apart back-to-back measurements of one run are on this machine: the floor under any prediction made
from a measurement before the first step.

Plans one run on the CPU (as bench/plan_accuracy.py does), then runs `nanopt preflight` on it N times in a row,
nothing changed between them, and reports each measured rate and the spread (the slowest and the fastest against
the median). Where 10-s measurements of the same run differ by 20%, a prediction from one of them cannot promise
10%. One line is appended to bench/results.jsonl.

    python bench/preflight_spread.py                      # a 2-minute plan, 8 preflights: about 3 minutes
    python bench/preflight_spread.py --budget 10min --repeats 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
from pathlib import Path

from plan_accuracy import REPO, commit, nanopt, preflight_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="2min")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results.jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="preflight-spread-") as tmp:
        data, run = Path(tmp) / "stdlib", Path(tmp) / "run"
        nanopt("tokenize", "--out", str(data))
        nanopt("plan", "--budget", args.budget, "--gpu", "cpu", "--data", str(data), "--out", str(run))
        rates, threads = [], []
        for _ in range(args.repeats):
            measured = preflight_rate(run)
            rates.append(measured["tokens_per_s"])
            threads.append(measured["threads"])
            print(f"{measured['tokens_per_s']:,.0f} tokens/s over {measured['steps']} steps", flush=True)
    median = statistics.median(rates)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "bench": "preflight_spread", "commit": commit(), "machine": f"{os.cpu_count()} CPUs",
              "budget": args.budget, "tokens_per_s": [round(r, 1) for r in rates], "threads": threads,
              "median": round(median, 1), "slowest_over_median": round(min(rates) / median, 3),
              "fastest_over_median": round(max(rates) / median, 3)}
    with args.results.open("a") as results:
        results.write(json.dumps(record) + "\n")
    print(f"median {median:,.0f} tokens/s; slowest {record['slowest_over_median']:.3f}, fastest "
          f"{record['fastest_over_median']:.3f} of it ({args.repeats} preflights, threads {sorted(set(threads))})")


if __name__ == "__main__":
    main()
