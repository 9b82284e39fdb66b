"""The GPU-marked tests (`-m gpu`), cheapest files first, so that a step ended by its budget has run the most tests
it could; each test's outcome is in gpu_tests.txt as it happens. The slow ones (a run killed and resumed on CUDA,
in fp32 and in fp16 with its loss scale) come after the quick ones: three tiny training processes each, and no
window had run them."""

from __future__ import annotations

import re
import subprocess
import sys

from gpusession.isolation import child_env
from gpusession.records import REPO, Context, append_record, base_record

# Cheapest first (by what each GPU test starts: no process, one tiny run, a profiled run, a search with trials);
# a file not named here runs after these, before the search.
CHEAPEST_FIRST = ("test_gpu_table.py", "test_weight_copies.py", "test_cuda_graphs.py", "test_allocator.py",
                  "test_step_sync.py", "test_prefetch.py", "test_profile.py", "test_gpu_lifecycle.py")
KILL_AND_RESUME = ("test_train.py", "test_fp16.py")  # after the files not named here
LAST = ("test_find_batch.py",)  # compiled searches: a fresh process and compilation per trial
MARKS = "gpu"
OUTCOMES = ("passed", "failed", "skipped", "deselected", "error", "errors", "xfailed", "xpassed")


def gpu_test_files() -> list[str]:
    """The test files with GPU-marked tests, cheapest first: collecting only them keeps the step short."""
    files = [p.name for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text()]

    def rank(name: str) -> tuple[int, int, str]:
        if name in CHEAPEST_FIRST:
            return 0, CHEAPEST_FIRST.index(name), name
        if name in KILL_AND_RESUME:
            return 2, KILL_AND_RESUME.index(name), name
        return (3, LAST.index(name), name) if name in LAST else (1, 0, name)

    return [f"tests/{name}" for name in sorted(files, key=rank)]


def step_gpu_tests(ctx: Context) -> None:
    """pytest -m gpu on those files; in a smoke run one file, to show the step works."""
    target = ["tests/test_gpu_table.py"] if ctx.smoke else gpu_test_files()
    # Each test's seconds in the report (those over one), so each window's plan can put the cheap ones first.
    argv = [sys.executable, "-m", "pytest", "-m", MARKS, "-o", "addopts=", "-v", "-ra", "-p", "no:cacheprovider",
            "--durations=0", "--durations-min=1", *target]
    record = base_record(ctx, "gpu-tests", f"python3 -m pytest -m '{MARKS}' -v " + " ".join(target))
    report = ctx.out / "gpu_tests.txt"
    with open(report, "w") as f:  # written as the tests run: a step killed at its budget leaves what ran
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())
    output = report.read_text(errors="replace")
    # pytest's last line: "2 passed, 1 skipped, 500 deselected in 3.1s"
    summaries = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|deselected)", line)]
    summary = summaries[-1].strip("= ") if summaries else output.strip()[-200:]
    print(summary, flush=True)
    counts = {key: 0 for key in ("passed", "failed", "skipped", "deselected", "error")}
    for count, key in re.findall(r"(\d+) (" + "|".join(OUTCOMES) + ")", summary):
        key = "error" if key == "errors" else key
        counts[key] = counts.get(key, 0) + int(count)
    not_passed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    # pytest's durations: "12.34s call     tests/test_x.py::test_y"; a test's phases summed
    seconds: dict[str, float] = {}
    for took, test in re.findall(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)", output, flags=re.MULTILINE):
        seconds[test] = round(seconds.get(test, 0.0) + float(took), 1)
    slowest = dict(sorted(seconds.items(), key=lambda item: -item[1])[:8]) or None
    record.update(exit_code=done.returncode, summary=summary[:300], failed_tests=not_passed[:10] or None, **counts,
                  slowest_tests=slowest,
                  status="ok" if done.returncode in (0, 5) else f"failed (exit {done.returncode})")
    append_record(ctx.out, record)  # failing tests are a finding of this step, not its failure
