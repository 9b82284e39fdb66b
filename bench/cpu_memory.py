"""How close the memory model's CPU peak is to what `nanopt train` measures, and what the process holds before its
first tensor.

Plans runs on the CPU (as bench/plan_accuracy.py does: `nanopt plan --budget B --gpu cpu`), trains each as a user
does (`nanopt train --json`, its evaluations, loss chart and checkpoints included) and reads the session's own
predicted-against-measured row for peak memory. Also measures, in a fresh process, the resident memory after
nanopt's imports, split into anonymous memory and the libraries' file pages: the part of the CPU's runtime allowance
(nanopt.model.memory.CPU_RUNTIME_OVERHEAD_BYTES) that varies between installs. One line per run is appended to
bench/results.jsonl.

    python bench/cpu_memory.py                      # the README's 2-minute plan: about 3 minutes
    python bench/cpu_memory.py --budget 2min --budget 5min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plan_accuracy import REPO, commit, nanopt

MIB = 2**20
IMPORTS = """
import json, torch, nanopt.train.loop, nanopt.evaluate.report
fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile")}))
"""


def after_imports() -> dict[str, float]:
    """MiB resident after torch's and nanopt's training imports, in a process of its own."""
    done = subprocess.run([sys.executable, "-c", IMPORTS], cwd=REPO, capture_output=True, text=True, check=True)
    return {key: round(value / MIB, 1) for key, value in json.loads(done.stdout).items()}


def trained_peak(run: Path) -> dict[str, float]:
    """`nanopt train --json` on a planned run: its predicted and measured peak memory (MiB) and their ratio."""
    done = subprocess.run([sys.executable, "-m", "nanopt", "train", str(run), "--json", "--no-live"], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nanopt train {run}: exit status {done.returncode}\n{done.stderr[-2000:]}")
    rows = {row["key"]: row for row in json.loads(done.stdout)["prediction"]["rows"]}
    peak = rows["peak_memory_bytes"]
    return {"predicted_mib": round(peak["predicted"] / MIB, 1), "measured_mib": round(peak["measured"] / MIB, 1),
            "ratio": round(peak["ratio"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", action="append", help="a `nanopt plan --budget` (repeatable; default 2min)")
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results.jsonl")
    args = parser.parse_args()
    imports = after_imports()
    print(f"after the imports: {imports['VmRSS']:.0f} MiB ({imports['RssAnon']:.0f} anonymous, "
          f"{imports['RssFile']:.0f} of the libraries' file pages)", flush=True)
    with tempfile.TemporaryDirectory(prefix="cpu-memory-") as tmp:
        data = Path(tmp) / "stdlib"
        nanopt("tokenize", "--out", str(data))
        for budget in args.budget or ["2min"]:
            run = Path(tmp) / f"run-{budget}"
            nanopt("plan", "--budget", budget, "--gpu", "cpu", "--data", str(data), "--out", str(run))
            model = json.loads((run / "plan.json").read_text())["model"]
            peak = trained_peak(run)
            record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "bench": "cpu_memory", "commit": commit(), "machine": f"{os.cpu_count()} CPUs",
                      "budget": budget, "params": model.get("params"), "after_imports_mib": imports, **peak}
            with args.results.open("a") as results:
                results.write(json.dumps(record) + "\n")
            print(f"{budget}: predicted {peak['predicted_mib']:.0f} MiB, measured {peak['measured_mib']:.0f} MiB, "
                  f"measured / predicted {peak['ratio']:.3f}", flush=True)


if __name__ == "__main__":
    main()
