"""The cost of run health (nanopt.train.health.probe and health): training steps with it on against off, side by
side in one run, reported as a ratio.

    python bench/bench_health.py --run runs/demo                                  # CPU: the demo's model
    python bench/bench_health.py --run runs/gpt2-small --micro-batch 16 --blocks 20   # one GPU

nanopt's real step (nanopt.train.step.step, as bench/bench_train.py builds it: compile per train.json, random
tokens) runs in blocks of `log_interval` steps (the run's: 10 in every preset), the blocks alternating health on and
off, so load on a shared machine falls on both alike. A block with health on does what training does: the probe
measures the block's last step (per-block gradient norms, the parameter copy and the update norms, one host read),
and the monitor counts each step and judges the block's record. Prints the median step time of each side, their
ratio, and the health work's own time per block as a share of the block's steps (timed around the health calls
alone, with a device synchronisation), for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import random_token_session  # noqa: E402

from nanopt.config import RunConfig, load_run  # noqa: E402
from nanopt.runtime import Runtime, init_runtime  # noqa: E402
from nanopt.train.health.probe import HealthProbe  # noqa: E402
from nanopt.train.health.verdicts import HealthMonitor, HealthSettings  # noqa: E402
from nanopt.train.step import step  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class HealthOverhead:
    """Median step time with health off and on (blocks of `interval` steps alternating), the monitor's Python work
    per block, and the probe's log-step work timed alone, both as shares of a block's steps."""

    interval: int
    blocks: int
    off_s: float
    on_s: float
    monitor_s: float
    probe_share: float

    @property
    def ratio(self) -> float:
        return self.on_s / self.off_s

    @property
    def monitor_share(self) -> float:
        return self.monitor_s / (self.off_s * self.interval)


def measure_overhead(run: RunConfig, rt: Runtime, blocks: int, warmup: int) -> HealthOverhead:
    """nanopt's step on random tokens, `warmup` untimed blocks (compilation), then `blocks` timed blocks per side."""
    session = random_token_session(run, rt)
    probe = HealthProbe(session.prepared.raw, session.optimizer, rt)
    monitor = HealthMonitor(HealthSettings.from_run(run))
    interval = run.train.log_interval
    times: dict[bool, list[float]] = {True: [], False: []}
    health_work: list[float] = []
    for block in range(warmup + 2 * blocks):
        on = block % 2 == 0
        session.health_probe = probe if on else None
        sync(rt.device)
        started = time.perf_counter()
        work = 0.0
        for _ in range(interval):
            loss, norm, _stop = step(session)
            if on:
                tick = time.perf_counter()
                monitor.observe_step(session.state.step, loss, norm)
                work += time.perf_counter() - tick
        if on:
            tick = time.perf_counter()
            record = {"step": session.state.step, "loss": loss, "grad_norm": norm, "lr": 1e-3,
                      **session.health_signals, "health_blocks": monitor.take_pending()}
            monitor.observe(record)
            work += time.perf_counter() - tick
        sync(rt.device)
        elapsed = time.perf_counter() - started
        if block >= warmup:
            times[on].append(elapsed / interval)
            if on:
                health_work.append(work)
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    probe_share = _probe_share(session, probe, rt.device, off_s * interval)
    return HealthOverhead(interval, blocks, off_s, on_s, statistics.median(health_work), probe_share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/demo"))
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the run's micro_batch_size")
    parser.add_argument("--blocks", type=int, default=10, help="timed blocks per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed blocks first (compilation)")
    args = parser.parse_args()
    overrides = {"micro_batch_size": args.micro_batch} if args.micro_batch else {}
    run = load_run(args.run, overrides)
    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    m = measure_overhead(run, rt, args.blocks, args.warmup)
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"device: {rt.device} {rt.precision}, torch {torch.__version__}, log_interval {m.interval}, "
          f"{args.blocks} blocks of {m.interval} steps per side, micro-batch {run.train.micro_batch_size} x "
          f"{run.seq_len}")
    print(f"step time, health off: {m.off_s * 1e3:.2f} ms; health on: {m.on_s * 1e3:.2f} ms; on / off = "
          f"{m.ratio:.4f}")
    print(f"monitor (Python, per block): {m.monitor_s * 1e3:.3f} ms = {m.monitor_share:.4%} of the block's steps")
    print(f"probe on its log step (norms, parameter copy, update norms, read): {m.probe_share:.4%} of the block's "
          f"steps")


def _probe_share(session: object, probe: HealthProbe, device: torch.device, block_s: float, repeats: int = 10) -> float:
    """The probe's own work at one log step, timed alone (median of `repeats`) over the time of a block: what the
    A/B ratio cannot resolve on a loaded machine. The parameters are copied and compared without an update between
    (the cost is the same)."""
    spent = []
    for param in probe.params:  # gradients to measure, as after a backward
        param.grad = torch.ones_like(param)
    for _ in range(repeats):
        sync(device)
        tick = time.perf_counter()
        probe.gradients()
        probe.before_update()
        probe.after_update()
        probe.read()
        sync(device)
        spent.append(time.perf_counter() - tick)
    session.optimizer.zero_grad(set_to_none=True)
    return statistics.median(spent) / block_s


if __name__ == "__main__":
    main()
