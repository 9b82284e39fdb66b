"""`nanopt eval RUN --health` on the metrics.jsonl of a long run (millions of lines): memory bounded whatever its
length, time linear in it. Each replay runs the CLI as the child of a fresh interpreter, which reports the child's
peak resident memory once it has exited (getrusage(RUSAGE_CHILDREN)): nothing else this test process started
counts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainhelp import HIDE_CUDA, make_run

# Above the peak of replaying a 1,000-line file (the interpreter, torch and matplotlib: ~400 MB): the monitor's
# windows and the chart's thinned curves are a few MB; a line is read whole only up to 1 MiB.
GROWTH_BOUND_MB = 100
BLOCK = 100  # steps per block of a run of millions of steps (nanopt.train.health.verdicts.MAX_BLOCK_STEPS)

_MEASURE = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "nanopt", "eval", sys.argv[1], "--health", "--json"],
                      capture_output=True, text=True)
print(json.dumps({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-2000:],
                  "seconds": time.perf_counter() - started,
                  "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def write_metrics(path: Path, lines: int) -> None:
    """`lines` train records as a run logging every step writes them (short: the fields the monitor and the chart
    read, and the share clipped an older run's carry), a block of the steps' numbers every BLOCK steps; the loss
    falls, the norm wanders around 0.8."""
    with open(path, "w") as f:
        chunk = []
        for step in range(1, lines + 1):
            loss = 3.0 + 4.0 / math.sqrt(step) + (step * 7919 % 100) / 1000
            blocks = "[]"
            if step % BLOCK == 0:
                blocks = (f'[{{"first": {step - BLOCK + 1}, "last": {step}, "steps": {BLOCK}, "losses": {BLOCK}, '
                          f'"loss_sum": {loss * BLOCK!r}, "loss_squares": {loss * loss * BLOCK!r}, '
                          f'"norm_median": 0.8{step % 9}, "norm_max": 1.5, "clipped": 10}}]')
            chunk.append(f'{{"kind": "train", "step": {step}, "tokens": {step * 2048}, "loss": {loss!r}, '
                         f'"lr": 0.003, "grad_norm": 0.8{step % 7}, "update_ratio": {{"decay": 0.0021}}, '
                         f'"clipped_fraction": 0.0, "health_blocks": {blocks}}}\n')
            if len(chunk) == 100_000:
                f.write("".join(chunk))
                chunk = []
        f.write("".join(chunk))


def replay_in_child(root: Path, dataset: Path, lines: int) -> dict:
    """The replay of a run of `lines` logged steps: its report, seconds and peak memory (the file is removed
    after: ten million lines take 2 GB)."""
    run = make_run(root, dataset, name=f"lines-{lines}", max_steps=10_000_000, warmup_steps=2000)
    write_metrics(run / "metrics.jsonl", lines)
    measured = subprocess.run([sys.executable, "-c", _MEASURE, str(run)], capture_output=True, text=True,
                              env={**os.environ, **HIDE_CUDA}, timeout=3000)
    (run / "metrics.jsonl").unlink()
    result = json.loads(measured.stdout)
    assert result["returncode"] == 0, result["stderr"]
    result["report"] = json.loads(result["stdout"])
    return result


@pytest.mark.slow  # ~10 s of a 2-core CPU: make test keeps under its 5 minutes
def test_eval_health_of_200k_lines_stays_within_the_bound(tmp_path: Path, tiny_dataset: Path):
    small = replay_in_child(tmp_path, tiny_dataset, 1000)
    large = replay_in_child(tmp_path, tiny_dataset, 200_000)
    assert large["report"]["signals"]["step"] == 200_000  # read to the end
    assert large["report"]["chart"]
    assert large["peak_mb"] - small["peak_mb"] < GROWTH_BOUND_MB, (small["peak_mb"], large["peak_mb"])


@pytest.mark.slow
def test_eval_health_of_10_million_lines_is_bounded_in_memory_and_linear_in_time(tmp_path: Path,
                                                                                  tiny_dataset: Path):
    small = replay_in_child(tmp_path, tiny_dataset, 1000)
    million = replay_in_child(tmp_path, tiny_dataset, 1_000_000)
    ten_million = replay_in_child(tmp_path, tiny_dataset, 10_000_000)
    assert ten_million["report"]["signals"]["step"] == 10_000_000
    assert ten_million["peak_mb"] - small["peak_mb"] < GROWTH_BOUND_MB, (small["peak_mb"], ten_million["peak_mb"])
    # Time past the start-up (imports, the data's checks): ten times the lines, about ten times the time.
    ratio = (ten_million["seconds"] - small["seconds"]) / (million["seconds"] - small["seconds"])
    assert 5 < ratio < 20, (small["seconds"], million["seconds"], ten_million["seconds"])


def test_a_thinned_curve_is_bounded_and_keeps_its_extremes():
    """The chart's curves: 300,000 points thinned to at most two per run of points, the highest spike and the
    lowest dip among them, in the order they came."""
    from nanopt.train.observe.metrics import CHART_BUCKETS, Thinned

    curve = Thinned()
    values = {step: 1.0 + (step * 7919 % 1000) / 10_000 for step in range(1, 300_001)}
    values[123_457], values[250_001] = 50.0, -3.0  # one spike, one dip
    for step, value in values.items():
        curve.add(step, value)
    curve.add(300_001, float("nan"))  # a chart cannot place it
    steps, kept = curve.points()
    points = dict(zip(steps, kept, strict=True))
    assert len(steps) <= 2 * CHART_BUCKETS and steps == sorted(steps)
    assert points[123_457] == 50.0 and points[250_001] == -3.0
    run = 2 * 300_000 // CHART_BUCKETS  # points a run of them spans, at the most
    assert steps[0] <= run and steps[-1] > 300_000 - run  # evenly over the whole curve
    assert all(values[step] == value for step, value in points.items())
