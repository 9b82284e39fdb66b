"""How honest `nanopt preflight` is: preflight a copy of runs/demo, then train that copy for real on the same machine,
and compare the projected time of each phase with the time the run really spent in it (its metrics.jsonl `phases`
records, read through nanopt.train.observe.phases.run_time).

The copy lives in a temporary directory (its train.json pointing at the repository's dataset), so runs/demo is never
touched. Both commands run as a user runs them, one process each, one after the other. The projection leaves out
"other" time (log lines, the loss chart, waiting), so the phases it does project are compared with the same phases
of the real run, and the real wall time is shown beside them. Ends with one JSON line.

    python bench/preflight_accuracy.py                        # about 6 minutes of both cores: the whole demo
    python bench/preflight_accuracy.py --set max_steps=60     # a quick check that the script works
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("setup", "train", "eval", "checkpoint")


def nanopt(*args: str) -> tuple[int, str, float]:
    """Exit status, stdout and wall seconds of one `nanopt` command in a process of its own (stderr passes through,
    so a failure says why)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nanopt", *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    return done.returncode, done.stdout, time.perf_counter() - started


def copy_run(source: Path, into: Path) -> Path:
    """model.json and train.json of `source`, with train.json's dataset made absolute so the copy finds it."""
    from nanopt.config import load_run

    copy = into / source.name
    copy.mkdir()
    shutil.copy(source / "model.json", copy / "model.json")
    train = json.loads((source / "train.json").read_text(encoding="utf-8"))
    train["data"] = str(load_run(source).data_dir.resolve())
    (copy / "train.json").write_text(json.dumps(train, indent=2), encoding="utf-8")
    return copy


def compare(projected: dict[str, Any], real: Any, train_wall_s: float) -> dict[str, Any]:
    seconds = projected["seconds"]
    projected_total = sum(seconds[name] for name in PHASES)
    real_total = sum(real.seconds[name] for name in PHASES)
    return {
        "phases": {name: {"projected_s": seconds[name], "real_s": real.seconds[name],
                          "ratio": seconds[name] / real.seconds[name] if real.seconds[name] else None}
                   for name in PHASES},
        "projected_total_s": projected_total, "real_total_s": real_total,
        "total_ratio": projected_total / real_total,
        "real_other_s": real.seconds["other"], "real_wall_s": real.wall_seconds,
        "wall_ratio": projected_total / real.wall_seconds, "train_process_wall_s": train_wall_s,
    }


def render(result: dict[str, Any]) -> None:
    print(f"{'phase':<12}{'projected':>12}{'real':>12}{'ratio':>8}")
    for name, row in result["phases"].items():
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        print(f"{name:<12}{row['projected_s']:>11.1f}s{row['real_s']:>11.1f}s{ratio:>8}")
    print(f"{'total':<12}{result['projected_total_s']:>11.1f}s{result['real_total_s']:>11.1f}s"
          f"{result['total_ratio']:>8.3f}")
    print(f"real other time {result['real_other_s']:.1f}s (not projected); real wall time "
          f"{result['real_wall_s']:.1f}s (projection / wall {result['wall_ratio']:.3f}); the train process ran "
          f"{result['train_process_wall_s']:.1f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=REPO / "runs" / "demo", help="the run directory to copy")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a train.json override for both commands, e.g. max_steps=60 (repeatable)")
    parser.add_argument("--steps", type=int, default=30, help="steps preflight measures")
    args = parser.parse_args()
    from nanopt.train.observe.metrics import read_metrics
    from nanopt.train.observe.phases import run_time

    overrides = [word for pair in args.sets for word in ("--set", pair)]
    with tempfile.TemporaryDirectory(prefix="nanopt-preflight-bench-") as folder:
        run = copy_run(args.run.resolve(), Path(folder))
        status, out, _ = nanopt("preflight", str(run), "--json", "--steps", str(args.steps), *overrides)
        if status not in (0, 1):  # 1: a check failed, which this bench reports but does not need
            sys.exit(f"nanopt preflight failed with status {status}")
        report = json.loads(out)
        status, _, train_wall_s = nanopt("train", str(run), "--resume", "none", "--no-live", "--json", *overrides)
        if status != 0:
            sys.exit(f"nanopt train failed with status {status}")
        real = run_time(read_metrics(run))
        if real is None:
            sys.exit("the run recorded no phases: this nanopt does not time its phases")
    result = {"run": str(args.run), "overrides": args.sets, "device": report["device"]["name"],
              "preflight_steps": report["steps"], "checks_failed": report["failed"],
              "step_time_s": report["step_time_s"], **compare(report["projection"], real, train_wall_s)}
    render(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
