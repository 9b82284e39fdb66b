"""The MFU `nanopt plan` measured on a CPU (nanopt.plan.recipe.probe), as plan.json keeps it, read back so that
`nanopt estimate` and the prediction `nanopt train` records use the rate the plan was made at, while the run's
speed settings are still the planned ones (a preflight.json that matches the run comes first).

plan.json's "throughput": {"source": "measured", "mfu": ..., "fingerprint": the planned run's speed settings
(nanopt.plan.preflight_record.fingerprint), ...}; a plan made at an assumed MFU has "source": "assumed", which
says nothing a default would not.
"""

from __future__ import annotations

import math
from typing import Any

from nanopt.config import RunConfig
from nanopt.cpu_threads import other_threads
from nanopt.errors import NanoptError
from nanopt.hardware import CPU
from nanopt.parsing import read_json
from nanopt.plan.preflight_record import changed_setting, fingerprint
from nanopt.rundir import RunDir

PLAN_MAX_BYTES = 1 << 20  # a plan.json is a few kilobytes
SOURCE = "plan-measured"


def planned_mfu(run: RunConfig, key: str, num_gpus: int, cpu_threads: int | None = None) -> tuple[float, str] | None:
    """(the MFU the plan measured, plan.json's path) when it applies to this estimate (a CPU estimate of the run as
    planned, with the torch threads it trains with when they are known), else None: a missing, damaged or
    hand-edited plan.json, a run changed since, or a measurement with other threads falls back quietly to the
    assumed MFU, as a run nanopt plan did not write does."""
    path = RunDir(run.run_dir).plan_json
    if key != CPU or num_gpus != 1 or not path.is_file():
        return None
    try:
        data = read_json(path, max_bytes=PLAN_MAX_BYTES)
    except NanoptError:
        return None
    throughput = data.get("throughput") if isinstance(data, dict) else None
    if not isinstance(throughput, dict) or throughput.get("source") != "measured":
        return None
    mfu = throughput.get("mfu")
    if not (isinstance(mfu, float) and math.isfinite(mfu) and 0 < mfu <= 1):
        return None
    if changed_setting(throughput.get("fingerprint"), fingerprint(run, 1)) is not None:
        return None
    if other_threads(throughput.get("threads"), cpu_threads) is not None:
        return None
    return mfu, str(path)


def describe(source: dict[str, Any]) -> str:
    return f" (measured by nanopt plan on this CPU: MFU {source['mfu']:.1%}, {source['path']})"
