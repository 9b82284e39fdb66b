"""On a CPU `nanopt plan` plans for the machine it runs on, so it measures the planned model's optimizer step there
instead of assuming an MFU: a handful of real training steps (nanopt.train.session, the loader included) of the
run as planned, on its dataset, with the threads `nanopt train` would choose; of a large run, steps cut short (below).

Why measure: on a CPU no one MFU fits. The step's efficiency swings with the model's width (a 128-wide model's
GEMMs run far closer to the peak than a 64-wide one's) and with the clock the cores really run at, which the counted
peak cannot know; the assumed MFU left runs planned for 2, 5 and 10 minutes taking 0.82, 0.77 and 0.59 of their
predicted time (bench/RESULTS.md). Each measurement costs some seven seconds; on a GPU the plan is usually made
elsewhere than the run, and the assumed MFU stands until `nanopt preflight`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nanopt.config import RunConfig

WARMUP = 3  # steps run first and not timed (allocations, first touches, the thread pool's start)...
WARMUP_S = 1.0  # ...or fewer where they take this long: the first step at least
MIN_TIMED_S = 6.0  # time at least this many seconds of steps: a shared machine's rate dips by a quarter for a second
# or two (a 2-s measurement once planned at 31k tokens/s a run that held 42k, bench/RESULTS.md); the preflight
# measures 10 s, the plan up to MAX_PROBES times and so a little less
# A large plan's step (a budget of CPU-days: a micro-batch of seconds, dozens of them a step) is not timed whole: the
# measurement runs steps of at most two micro-batches (as find-batch's trials do) of at most the sequences that
# take about MICRO_BATCH_S at the assumed MFU, and stops after MAX_S once MIN_TIMED steps are timed.
MICRO_BATCH_S = 1.0
MAX_S = 20.0
MIN_TIMED = 2
MAX_STEPS = 1000  # or the run's own steps, if fewer: the run takes no more


@dataclass(frozen=True)
class Probe:
    """What the measurement found: the median optimizer step, the tokens per second it gives, and how."""

    tokens_per_s: float
    step_s: float
    steps: int
    threads: int | None
    device_name: str

    def mfu(self, flops_per_token: float, peak_flops: float) -> float:
        """The measured rate as a fraction of the peak the plan counts for this CPU; at most 1 (a higher value
        would say the counted peak is too low, and the plan then plans at the peak)."""
        return min(1.0, self.tokens_per_s * flops_per_token / peak_flops)


def measure_cpu_step(run: RunConfig, assumed_flops_per_s: float) -> Probe:
    """Time the run's optimizer step on this machine's CPU (see the module docstring; a large step in part, as said
    above, `assumed_flops_per_s` sizing the part); nothing is written."""
    from nanopt.devices import device_name
    from nanopt.runtime import runtime_on
    from nanopt.train.session import build_session

    rt = runtime_on("cpu")  # the threads `nanopt train` would choose, said in rt.cpu_threads
    measured = measured_run(run, assumed_flops_per_s)
    session = build_session(measured, rt, writes=False)
    timed = _timed_steps(session)
    del session
    step_s = sum(timed) / len(timed)  # the mean, as a run's time is: its slow steps count
    return Probe(tokens_per_s=measured.train.global_batch_tokens / step_s, step_s=step_s, steps=len(timed),
                 threads=rt.cpu_threads.threads if rt.cpu_threads else None, device_name=device_name(rt.device))


def measured_run(run: RunConfig, assumed_flops_per_s: float) -> RunConfig:
    """The run as measured: its micro-batch cut to what takes about MICRO_BATCH_S, in steps of at most two."""
    from nanopt.model.flops import flops_per_token
    from nanopt.plan.find_batch.search import trial_run

    per_sequence_s = flops_per_token(run.model, run.seq_len) * run.seq_len / assumed_flops_per_s
    micro = max(1, min(run.train.micro_batch_size, int(MICRO_BATCH_S / per_sequence_s)))
    if micro == run.train.micro_batch_size and run.grad_accum_steps(1) <= 2:
        return run  # measured whole
    return trial_run(run, micro, 1)


def _timed_steps(session: Any) -> list[float]:
    """The seconds of each step after the warmup: MIN_TIMED_S of them, or (a large plan's long steps) as many as MAX_S
    in all allows, MIN_TIMED at least; never more steps than MAX_STEPS or the run's."""
    from nanopt.train.step import step

    most = max(WARMUP + MIN_TIMED, min(MAX_STEPS, session.total_steps))
    times: list[float] = []
    warmup = 0  # steps not timed, known once the warmup has ended
    while True:
        started = time.perf_counter()
        step(session)
        times.append(time.perf_counter() - started)
        if not warmup:
            if len(times) >= WARMUP or sum(times) >= WARMUP_S:
                warmup = len(times)
            continue
        timed = times[warmup:]
        enough = sum(timed) >= MIN_TIMED_S or sum(times) >= MAX_S or len(times) >= most
        if len(timed) >= MIN_TIMED and enough:
            return timed


def probe_record(probe: Probe, mfu: float) -> dict[str, Any]:
    return {"tokens_per_s": probe.tokens_per_s, "step_s": probe.step_s, "steps": probe.steps, "mfu": mfu,
            "threads": probe.threads, "device": probe.device_name}
