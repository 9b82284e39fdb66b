"""What a preflight measured (`Measured`, the slowest rank's figures), turned into preflight.json's report: the
throughput and MFU, the projection of the whole run per phase and its cost, the comparison with `nanopt estimate`,
and the checks (the loss falls, memory is flat, the loader keeps up).

Imports nanopt.plan.estimate (for the comparison) and nanopt.plan.preflight_record (the file's format); torch only
inside the functions that need the device.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from nanopt.config import RunConfig
from nanopt.config.seq_stages import longest
from nanopt.errors import ConfigError
from nanopt.hardware import CPU
from nanopt.plan.preflight_record import FORMAT_VERSION, fingerprint

# The checks. Losses: the mean of the last `window` measured steps must lie below the mean of the first `window` by
# more than LOSS_NOISE_Z standard errors of that difference, so batch-to-batch noise over a flat loss (a learning
# rate far too small) does not pass for learning; the window grows with the steps measured, up to LOSS_WINDOW.
# A schedule still warming up only lowers the learning rate, never reverses the fall.
LOSS_WINDOW = 10
LOSS_NOISE_Z = 2.0
# Memory: the peak at the end of the measured steps may exceed the peak after their first quarter by this much (the
# optimizer state exists from the first step on, so a growing peak is a leak, or fragmentation that will OOM later).
MEMORY_GROWTH_LIMIT = 0.05
# On a CPU the peak is the process's resident memory, which the C allocator moves by tens of MiB from step to step
# with no leak (0 to 36 MiB over 60 steps of a 0.3M-parameter model at ~680 MiB on the project's machine): growth up
# to this much passes whatever its share.
CPU_RESIDENT_SLACK_BYTES = 64 << 20
# The loader: waiting for data past this share of the step time is throughput lost to input.
LOADER_WAIT_LIMIT = 0.05

CHECK_LABELS = {"loss_falls": "loss falls", "memory_flat": "memory is flat",
                "loader_wait_small": "data-loader wait is small"}



@dataclass
class Measured:
    """What one rank measured (the slowest rank's figures once `_worst_of_ranks` has run)."""

    micro_batch: dict[str, Any]
    setup_s: float = 0.0
    warmup_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    loader_wait_s: float = 0.0
    peak_bytes: int = 0
    early_peak_bytes: int = 0
    end_peak_bytes: int = 0
    diverged: str | None = None
    skipped_steps: int = 0  # non-finite steps the optimizer skipped (warm-up included)
    chance_loss: float = math.inf  # ln(vocab_size): the loss of a model that knows nothing
    eval_s: float | None = None
    eval_first_s: float | None = None
    checkpoint_blocked_s: float = 0.0  # how long one save blocks the step
    checkpoint_writer_cpu_s: float = 0.0  # its background writer's CPU time, counted on a CPU only (else 0)

    @property
    def mean_step_s(self) -> float:
        return statistics.fmean(self.step_s or self.warmup_s)

    @property
    def checkpoint_s(self) -> float:
        """What one save costs the steps: its blocking, and on a CPU its writing, which runs on the steps' cores."""
        return self.checkpoint_blocked_s + self.checkpoint_writer_cpu_s

    @property
    def loader_wait_share(self) -> float:
        return min(1.0, self.loader_wait_s / max(sum(self.step_s), 1e-12))

    @property
    def memory_growth(self) -> float:
        return self.end_peak_bytes / self.early_peak_bytes - 1 if self.early_peak_bytes else 0.0


# ---------------------------------------------------------------------------------------------- the report


def build_report(run: RunConfig, rt: Any, price_per_hour: float | None, m: Measured) -> dict[str, Any]:
    from nanopt.devices import device_name

    device = {"name": device_name(rt.device), "kind": _device_kind(rt), "world_size": rt.world_size}
    step_s = m.mean_step_s
    tokens_per_s = run.train.global_batch_tokens / step_s
    throughput = _throughput(run, rt, tokens_per_s)
    projection = _projection(run, rt, price_per_hour, m, step_s)
    checks = _checks(m, on_cpu=rt.device.type == "cpu")
    now = time.time()
    report = {
        "version": FORMAT_VERSION,
        "time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "unix_time": round(now, 3), "run": str(run.run_dir), "device": device, "precision": rt.precision,
        "compile": _compiled(run, rt), "micro_batch": m.micro_batch, "grad_accum": run.grad_accum_steps(rt.world_size),
        "steps": {"warmup": len(m.warmup_s), "measured": len(m.step_s),
                  "seq_len": longest(run.seq_stages).seq_len},  # under seq_len stages, the longest's
        "step_time_s": step_s, "tokens_per_s": tokens_per_s, **throughput,
        "loader_wait_share": m.loader_wait_share,
        "memory": {"peak_bytes": m.peak_bytes, "early_peak_bytes": m.early_peak_bytes,
                   "end_peak_bytes": m.end_peak_bytes, "growth": m.memory_growth, "measure": _memory_measure(rt)},
        "losses": _losses(m),
        "eval_s": m.eval_s, "eval_first_s": m.eval_first_s, "checkpoint_s": m.checkpoint_s,
        "checkpoint_blocked_s": m.checkpoint_blocked_s, "checkpoint_writer_cpu_s": m.checkpoint_writer_cpu_s,
        "setup_s": m.setup_s,
        "projection": projection,
        "estimate": _estimate_comparison(run, device, projection, tokens_per_s),
        "checks": checks, "ok": all(c["ok"] for c in checks.values()),
        "failed": [name for name, c in checks.items() if not c["ok"]],
        "fingerprint": fingerprint(run, rt.world_size),
    }
    return report



def _device_kind(rt: Any) -> str | None:
    """The device as `nanopt estimate --gpu` names it: a GPU table key, "cpu", or None for a GPU not in the table."""
    if rt.device.type != "cuda":
        return CPU
    import torch

    from nanopt.hardware import detect_gpu

    gpu = detect_gpu(torch.cuda.get_device_name(rt.device))
    return gpu.key if gpu else None


def _compiled(run: RunConfig, rt: Any) -> bool:
    from nanopt.train.parallel.wrap import resolve_compile

    return resolve_compile(run.train.compile, rt.device)


def _memory_measure(rt: Any) -> str:
    return ("peak reserved GPU memory plus the CUDA context" if rt.device.type == "cuda"
            else "peak resident memory of the process")


def _throughput(run: RunConfig, rt: Any, tokens_per_s: float) -> dict[str, Any]:
    """MFU against each rank's dense peak (nanopt.devices.device_peak_flops: on a CPU, this machine's peak as
    `nanopt estimate --gpu cpu` works it out, which the ranks share), as training reports it."""
    from nanopt.devices import device_peak_flops
    from nanopt.model.flops import flops_per_token, mfu, mfu_note

    peak, source = device_peak_flops(rt.device, rt.precision, rt.tf32)
    measured_at = longest(run.seq_stages).seq_len  # the steps measured: the longest seq_len stage's
    utilization = mfu(tokens_per_s, flops_per_token(run.model, measured_at), rt.world_size, peak)
    return {"mfu": utilization, "mfu_note": mfu_note(utilization, peak), "peak_flops": peak, "peak_source": source}


def _losses(m: Measured) -> dict[str, Any]:
    window = _loss_window(len(m.losses))
    finite = [x if math.isfinite(x) else None for x in m.losses]
    first, last = m.losses[:window], m.losses[-window:]
    return {"window": window, "first_mean": _finite_mean(first), "last_mean": _finite_mean(last),
            "measured": finite}


def _loss_window(count: int) -> int:
    return max(1, min(LOSS_WINDOW, count // 3))


def _finite_mean(values: list[float]) -> float | None:
    mean = statistics.fmean(values) if values else math.nan
    return mean if math.isfinite(mean) else None


def _projection(run: RunConfig, rt: Any, price_per_hour: float | None, m: Measured, step_s: float) -> dict[str, Any]:
    """The whole run's time per phase at the measured durations, and its cost at the run's price."""
    from nanopt.devices import device_price
    from nanopt.train.observe.phases import occasions, projected_seconds

    seconds = projected_seconds(run, 0, step_s, m.eval_s, m.checkpoint_s, m.setup_s)
    evals = occasions(run.train.eval_interval, 0, run.total_steps) if run.train.eval_interval else 0
    if evals and m.eval_first_s is not None and m.eval_s is not None:
        seconds["eval"] += m.eval_first_s - m.eval_s  # what the first evaluation pays once
    total = sum(seconds.values())
    price, price_source = device_price(rt.device, price_per_hour if price_per_hour is not None
                                       else run.train.price_per_hour)
    cost = None if price is None else {name: s / 3600 * rt.world_size * price for name, s in seconds.items()}
    return {"seconds": seconds, "total_s": total,
            "shares": {name: s / total if total else 0.0 for name, s in seconds.items()},
            "steps": run.total_steps, "evaluations": evals,
            "checkpoints": occasions(run.train.checkpoint_interval, 0, run.total_steps),
            "cost_usd": cost, "total_cost_usd": None if cost is None else sum(cost.values()),
            "price_per_hour": price, "price_source": price_source, "devices": rt.world_size}



def _estimate_comparison(run: RunConfig, device: dict[str, Any], projection: dict[str, Any],
                         tokens_per_s: float) -> dict[str, Any]:
    """What `nanopt estimate` assumes for the same run on the same device, at its default MFU, and the ratios."""
    from nanopt.plan.estimate import DEFAULT_MFU, EstimateOptions, estimate

    kind, world = device["kind"], device["world_size"]
    if kind is None:
        return {"note": f"{device['name']} is not in nanopt's GPU table: estimate has no peak to assume from"}
    if kind == CPU and world > 1:
        return {"note": "nanopt estimate --gpu cpu describes one process on this machine, not several ranks"}
    try:
        assumed = estimate(run, EstimateOptions(gpu=kind, num_gpus=world, mfu=DEFAULT_MFU,
                                                price_per_hour=projection["price_per_hour"]))
    except ConfigError as exc:  # e.g. a CPU whose peak /proc/cpuinfo does not give
        return {"note": f"nanopt estimate --gpu {kind}: {exc.message}"}
    train_s = projection["seconds"]["train"]
    return {"gpu": kind, "mfu": assumed["gpu"]["mfu"], "tokens_per_s": assumed["tokens_per_second"],
            "train_seconds": assumed["train_seconds"], "cost_usd": assumed["cost_usd"],
            "ratio": {"tokens_per_s": tokens_per_s / assumed["tokens_per_second"],
                      "train_seconds": train_s / assumed["train_seconds"] if assumed["train_seconds"] else None}}


# ---------------------------------------------------------------------------------------------- the checks


def _checks(m: Measured, on_cpu: bool) -> dict[str, dict[str, Any]]:
    return {"loss_falls": _loss_check(m), "memory_flat": _memory_check(m, on_cpu),
            "loader_wait_small": _loader_check(m)}


def _loss_check(m: Measured) -> dict[str, Any]:
    if m.diverged:
        return {"ok": False, "detail": f"{m.diverged}: lower learning_rate"}
    if not m.losses:
        return {"ok": False, "detail": "no measured step"}
    window = _loss_window(len(m.losses))
    first, last = m.losses[:window], m.losses[-window:]
    if m.skipped_steps or not all(math.isfinite(x) for x in m.losses):
        return {"ok": False, "detail": f"non-finite losses ({m.skipped_steps} step(s) skipped): lower learning_rate"}
    if statistics.fmean(last) > 2 * m.chance_loss:  # falling or not, far worse than knowing nothing
        return {"ok": False, "detail": f"loss {statistics.fmean(last):,.4g} is far above ln(vocab_size) = "
                                       f"{m.chance_loss:.2f}, what a model that knows nothing scores: lower "
                                       "learning_rate"}
    drop = statistics.fmean(first) - statistics.fmean(last)
    noise = math.sqrt((_variance(first) + _variance(last)) / window)
    lr = f"learning rate up to {max(m.lrs):.3g}" if m.lrs else ""
    said = (f"mean of the first {window} measured steps {statistics.fmean(first):.4f}, of the last {window} "
            f"{statistics.fmean(last):.4f} ({lr})")
    if drop > LOSS_NOISE_Z * noise and drop > 0:
        return {"ok": True, "detail": said}
    hint = ("it rose: learning_rate may be too high" if drop < 0 else
            "no fall beyond the noise: learning_rate may be too low, or too few steps (--steps)")
    return {"ok": False, "detail": f"{said}: {hint}"}


def _variance(values: list[float]) -> float:
    return statistics.variance(values) if len(values) > 1 else 0.0


def _memory_check(m: Measured, on_cpu: bool) -> dict[str, Any]:
    growth = m.memory_growth
    slack = CPU_RESIDENT_SLACK_BYTES if on_cpu else 0
    limit = f"limit +{100 * MEMORY_GROWTH_LIMIT:.0f}%" + (f" or +{_mib(slack)}" if slack else "")
    detail = (f"peak {_mib(m.early_peak_bytes)} after the first quarter of the measured steps, {_mib(m.end_peak_bytes)}"
              f" at the end ({100 * growth:+.1f}%, {limit})")
    ok = growth <= MEMORY_GROWTH_LIMIT or m.end_peak_bytes - m.early_peak_bytes <= slack
    return {"ok": ok, "detail": detail}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _loader_check(m: Measured) -> dict[str, Any]:
    share = m.loader_wait_share
    return {"ok": share < LOADER_WAIT_LIMIT,
            "detail": f"{100 * share:.2f}% of the step time waiting for data (limit {100 * LOADER_WAIT_LIMIT:.0f}%)"}
