"""The stall watch when even its own thread cannot run: a C call that holds the GIL and does not return. Real
processes: one holds the GIL in a C loop, one waits with the GIL released (where the Python watch reports)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from clihelp import REPO

WATCHED = r"""
import sys, time
from nanopt.train.guard.stall import StallWatch

def hold_the_gil(seconds):
    # builtin sum over a range runs in C: no other thread can take the GIL until it returns
    n = 10 ** 6
    began = time.perf_counter()
    sum(range(n))
    sum(range(int(seconds * n / (time.perf_counter() - began))))

watch = StallWatch(2.0, lambda stall: print("python-stall", flush=True), lambda stall, s: print("python-over"))
watch.start()
watch.beat(1)
time.sleep(0.5)  # the watch polls (every 0.2 s) and arms faulthandler (for 2.4 s)
if sys.argv[1] == "gil":
    hold_the_gil(6.0)
else:
    time.sleep(4.0)
watch.stop()
time.sleep(3.0)  # stopped: nothing fires after it
print("done", flush=True)
"""


def _watched(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WATCHED, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # ~10 s of a 2-core CPU: make test keeps under its 5 minutes
def test_a_call_that_holds_the_gil_still_gets_every_threads_stack_on_stderr():
    result = _watched("gil")
    assert result.returncode == 0 and "done" in result.stdout, result.stderr
    assert result.stderr.count("Timeout (") == 1, result.stderr
    assert "in hold_the_gil" in result.stderr and "most recent call first" in result.stderr, result.stderr


def test_a_wait_that_releases_the_gil_is_reported_by_the_watch_alone():
    result = _watched("sleep")
    assert result.returncode == 0 and "done" in result.stdout, result.stderr
    assert "python-stall" in result.stdout and "Timeout (" not in result.stderr, (result.stdout, result.stderr)
