"""`nanopt preflight`: a few dozen real optimizer steps of a run, on the machine (and ranks) that will train it,
checked and projected to the run's end in time and money, without touching the run.

The session is the one training builds (`nanopt.train.session.build_session`, writes=False): the same model, dtype,
compile, accumulation, parallelism, loader and schedule from step 0. Nothing of the run is written: no checkpoint,
no metrics.jsonl, no lock; one evaluation and one checkpoint are measured into a temporary directory beside the run
directory (same filesystem), removed afterwards whatever happens. Rank 0 writes `preflight.json` (atomically).
With `--find-batch`, the micro-batch comes from `nanopt find-batch`'s search, which also leaves its
find_batch.json, as that command does.

Time is measured as nanopt.train.phases charges it: setup from the process start to the first step (and the first
step itself when compiled), the mean measured step, one in-loop evaluation and one
checkpoint save; `phases.projected_seconds` turns them into the run's time per phase.

preflight.json (`version` 1), one JSON object:

    key                        meaning
    version, time, unix_time   format version; when it was measured (ISO 8601 UTC, and Unix seconds)
    run                        the run directory
    device                     name (as CUDA or the OS reports it); kind (the GPU table key, "cpu", or null for a
                               GPU not in the table); world_size (ranks)
    precision, compile         as resolved on this device ("bf16" / "fp32"; true / false)
    micro_batch                size (measured); source ("train.json" or "find-batch"); train_json (the size
                               train.json has); advice ("set micro_batch_size N" when find-batch picked another)
    grad_accum                 micro-batches per optimizer step per rank
    steps                      warmup (run first, not measured: torch.compile's first step is among them) and
                               measured optimizer steps
    step_time_s                mean seconds of a measured optimizer step (the slowest rank)
    tokens_per_s               global_batch_tokens / step_time_s, over all ranks
    mfu, mfu_note,             MFU (nanopt.model.flops.mfu) against the device's dense peak; on a CPU against the
    peak_flops, peak_source    peak `nanopt estimate --gpu cpu` works out for this machine
    loader_wait_share          time inside the loader's next_batch over step time, measured steps, worst rank
    memory                     peak_bytes (the whole preflight); early_peak_bytes (after the first quarter of the
                               measured steps); end_peak_bytes; growth (end / early - 1); measure
    losses                     window; first_mean and last_mean (of the first and last `window` measured steps);
                               measured (every measured step's loss, null where not finite)
    eval_s, eval_first_s       one in-loop evaluation: a later one, and the first (which pays once, e.g. for
                               compiling the evaluation); null with eval_interval 0
    checkpoint_s               how long one checkpoint save blocks the step (copied to host memory, then written
                               in the background as training does, into a scratch directory beside the run
                               directory, waited for and removed afterwards)
    setup_s                    process start (as `nanopt train` bills it) to the first step, a find-batch search
                               excluded, plus the first step when compiled
    projection                 seconds per phase (setup, train, eval, checkpoint) for the whole run; total_s;
                               shares; the steps, evaluations and checkpoints counted; cost_usd per phase and
                               total_cost_usd (null without a price); price_per_hour, price_source, devices
    estimate                   what `nanopt estimate` assumes on this device: gpu, mfu, tokens_per_s,
                               train_seconds, cost_usd, ratio (measured / assumed tokens_per_s and
                               train_seconds); or a note saying why there is none
    checks, ok, failed         loss_falls, memory_flat, loader_wait_small, each {ok, detail}; whether all passed;
                               the names of those that did not
    fingerprint                the settings that decide speed: model (model.json), seq_len, micro_batch_size,
                               global_batch_tokens, precision, compile, activation_checkpointing, parallelism
                               (as train.json gives them), world_size. A run whose settings differ makes the file
                               stale: `nanopt estimate` then does not use it and says which setting changed.

Imports nanopt.train (the session measured), nanopt.evaluate.loss (training's in-loop validation, as nanopt.train
does), nanopt.plan.find_batch and nanopt.plan.estimate, nanopt.model, nanopt.runtime and the contracts. Torch is
imported inside the functions that run steps: `nanopt estimate` reads preflight.json through this module.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError, NanoptError
from nanopt.files import check_run_dir, remove_tree
from nanopt.hardware import CPU, MAX_SIZE_BYTES, check_price_per_hour
from nanopt.parsing import check_option, read_json, save_json
from nanopt.rundir import RunDir

FORMAT_VERSION = 1
MAX_PREFLIGHT_STEPS = 10_000  # a preflight of more steps is a typo: it would be the run itself

# The checks. Losses: the mean of the last `window` measured steps must lie below the mean of the first `window` by
# more than LOSS_NOISE_Z standard errors of that difference, so batch-to-batch noise over a flat loss (a learning
# rate far too small) does not pass for learning; the window grows with the steps measured, up to LOSS_WINDOW.
# A schedule still warming up only lowers the learning rate, never reverses the fall.
LOSS_WINDOW = 10
LOSS_NOISE_Z = 2.0
# Memory: the peak at the end of the measured steps may exceed the peak after their first quarter by this much (the
# optimizer state exists from the first step on, so a growing peak is a leak, or fragmentation that will OOM later).
MEMORY_GROWTH_LIMIT = 0.05
# The loader: waiting for data past this share of the step time is throughput lost to input.
LOADER_WAIT_LIMIT = 0.05

CHECK_LABELS = {"loss_falls": "loss falls", "memory_flat": "memory is flat",
                "loader_wait_small": "data-loader wait is small"}

# Settings that decide a step's speed: a preflight.json measured with others is stale.
SPEED_SETTINGS = ("seq_len", "micro_batch_size", "global_batch_tokens", "precision", "compile",
                  "activation_checkpointing", "parallelism")

Progress = Callable[[str, int, int], None]  # (stage, done, total): setup, warmup, steps, evaluation, checkpoint


@dataclass(frozen=True)
class PreflightOptions:
    steps: int = 30  # measured optimizer steps
    warmup: int = 3  # steps run first and not measured (torch.compile's first step among them)
    find_batch: bool = False  # the micro-batch `nanopt find-batch` picks instead of train.json's
    max_memory: int | None = None  # with find_batch on a CPU: the peak resident memory a trial may reach
    price_per_hour: float | None = None  # USD per device-hour; default train.json's, else the GPU table's
    started: float | None = None  # Unix time setup is measured from: the process start (the CLI); None: the call

    def validate(self) -> None:
        hint = f"need --steps >= 1 and --warmup >= 0, each at most {MAX_PREFLIGHT_STEPS:,}"
        check_option("--steps", self.steps, 1, MAX_PREFLIGHT_STEPS, hint)
        check_option("--warmup", self.warmup, 0, MAX_PREFLIGHT_STEPS, hint)
        check_price_per_hour(self.price_per_hour)
        check_option("--max-memory", self.max_memory, 1, MAX_SIZE_BYTES, "e.g. --max-memory 4GiB")
        if self.max_memory is not None and not self.find_batch:
            raise ConfigError("--max-memory bounds the trials of --find-batch, which was not asked for",
                              "add --find-batch, or leave --max-memory out")


# ---------------------------------------------------------------------------------------- the fingerprint


def fingerprint(run: RunConfig, world_size: int) -> dict[str, Any]:
    """The settings that decide the speed of a step, as JSON would give them back."""
    train = run.train
    settings = {"model": run.model.to_dict(), "seq_len": run.seq_len, "micro_batch_size": train.micro_batch_size,
                "global_batch_tokens": train.global_batch_tokens, "precision": train.precision,
                "compile": train.compile, "activation_checkpointing": train.activation_checkpointing,
                "parallelism": train.parallelism, "world_size": world_size}
    return json.loads(json.dumps(settings))


def changed_setting(recorded: Any, current: dict[str, Any]) -> str | None:
    """The first setting that differs between a preflight's fingerprint and the run's now, said for a person
    ("micro_batch_size: 8 when measured, 4 now"); None when they match."""
    if not isinstance(recorded, dict):
        return "its fingerprint is missing"
    for key in ("model", *SPEED_SETTINGS, "world_size"):
        then, now = recorded.get(key), current[key]
        if then == now:
            continue
        if key == "model":
            names = sorted(k for k in {*then, *now} if then.get(k) != now.get(k)) if isinstance(then, dict) else []
            return f"model.json {', '.join(names) or 'settings'} changed"
        return f"{key}: {json.dumps(then)} when measured, {json.dumps(now)} now"
    return None


def read_preflight(run_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the run's preflight.json, None), (None, None) when there is none, or (None, why it cannot be used, without
    the path): the fields `nanopt estimate` reads are checked, so a hand-edited or damaged file is a note, never a
    crash."""
    path = RunDir(run_dir).preflight_json
    if not path.is_file():
        return None, None
    try:
        data = read_json(path)
    except NanoptError as exc:
        return None, exc.message.removeprefix(f"{path}: ")
    problem = _unreadable_field(data)
    return (None, problem) if problem else (data, None)


def _unreadable_field(data: Any) -> str | None:
    from nanopt.hardware import GPUS

    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return f"not a version {FORMAT_VERSION} preflight.json"
    device, tokens_per_s = data.get("device"), data.get("tokens_per_s")
    if not (isinstance(tokens_per_s, (int, float)) and math.isfinite(tokens_per_s) and tokens_per_s > 0):
        return "no measured tokens_per_s"
    if not (isinstance(device, dict) and isinstance(device.get("name"), str)
            and (device.get("kind") is None or device.get("kind") in (CPU, *GPUS))
            and type(device.get("world_size")) is int and device["world_size"] >= 1):
        return "its device is not one nanopt describes"
    for key, kind in (("time", str), ("fingerprint", dict), ("steps", dict), ("projection", dict), ("failed", list)):
        if not isinstance(data.get(key), kind):
            return f"its {key!r} is missing or not a {kind.__name__}"
    return None


# -------------------------------------------------------------------------------------------- the preflight


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
    checkpoint_s: float = 0.0

    @property
    def mean_step_s(self) -> float:
        return statistics.fmean(self.step_s or self.warmup_s)

    @property
    def loader_wait_share(self) -> float:
        return min(1.0, self.loader_wait_s / max(sum(self.step_s), 1e-12))

    @property
    def memory_growth(self) -> float:
        return self.end_peak_bytes / self.early_peak_bytes - 1 if self.early_peak_bytes else 0.0


def preflight(run: RunConfig, opts: PreflightOptions, on_progress: Progress | None = None,
              on_trial: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Measure the run, project it, save runs/NAME/preflight.json (rank 0) and return the report (every rank)."""
    from nanopt.runtime import init_runtime, shutdown

    opts.validate()
    check_run_dir(run.run_dir)  # preflight.json is written there at the end: a link there is refused now
    billed_from = opts.started if opts.started is not None else time.time()
    run, micro_batch, searching_s = _micro_batch(run, opts, on_trial)
    rt = init_runtime(run.train.precision)
    try:
        measured = _measure(run, rt, opts, billed_from + searching_s, micro_batch, on_progress or _silent)
        report = _report(run, rt, opts, measured)
        if rt.is_main:
            save_json(RunDir(run.run_dir).preflight_json, report)
        return report
    finally:
        shutdown(rt)


def _silent(stage: str, done: int, total: int) -> None:
    pass


def _micro_batch(run: RunConfig, opts: PreflightOptions,
                 on_trial: Callable[[Any], None] | None) -> tuple[RunConfig, dict[str, Any], float]:
    """The run at the micro-batch to measure, where it came from, and the seconds a find-batch search took (not
    part of the run's setup: training does not search)."""
    configured = run.train.micro_batch_size
    if not opts.find_batch:
        return run, {"size": configured, "source": "train.json", "train_json": configured, "advice": None}, 0.0
    from nanopt.plan.find_batch.finder import find_batch
    from nanopt.plan.find_batch.search import DEFAULT_MAX, FindBatchOptions
    from nanopt.runtime import ranks

    # No size above the sequences each rank takes per step can divide the global batch: none is worth a trial.
    per_rank = run.train.global_batch_tokens // (run.seq_len * ranks().world_size)
    search = FindBatchOptions(maximum=max(1, min(DEFAULT_MAX, per_rank)), max_memory=opts.max_memory)
    started = time.time()
    report = find_batch(run, search, on_trial=on_trial)
    size = report["best_micro_batch"]
    if size is None or report["grad_accum_at_best"] is None:
        raise ConfigError(f"--find-batch: no micro-batch that fits divides the global batch of "
                          f"{run.train.global_batch_tokens:,} tokens exactly",
                          "change global_batch_tokens to a multiple of micro_batch_size x seq_len x world size "
                          "(`nanopt find-batch` shows the sizes that fit), or leave --find-batch out")
    advice = f"set micro_batch_size {size}" if size != configured else None
    chosen = replace(run, train=replace(run.train, micro_batch_size=size))
    return chosen, {"size": size, "source": "find-batch", "train_json": configured, "advice": advice}, \
        time.time() - started


def _measure(run: RunConfig, rt: Any, opts: PreflightOptions, billed_from: float, micro_batch: dict[str, Any],
             progress: Progress) -> Measured:
    from nanopt.data.dataset import open_run_dataset
    from nanopt.plan.profile import TimedLoader
    from nanopt.train.loop import validation_batches
    from nanopt.train.session import build_session

    progress("setup", 0, 1)
    session = build_session(run, rt, writes=False)
    # Training hashes a dataset of up to 1 GiB whole when it opens it (writes=True); that is part of its setup.
    open_run_dataset(run)
    if run.train.eval_interval:  # training checks the validation slice before its first step, too
        validation_batches(session)
    session.loader = TimedLoader(session.loader)
    measured = Measured(micro_batch=micro_batch)
    first_step_at = time.time()
    _run_steps(session, opts, measured, progress)
    # Setup is what training bills as setup: the process start to the first step, and that step when compiled.
    measured.setup_s = first_step_at - billed_from + (measured.warmup_s[0] if session.prepared.compiled and
                                                      measured.warmup_s else 0.0)
    _measure_eval_and_checkpoint(session, measured, progress)
    return _worst_of_ranks(rt, measured)


def _synchronize(rt: Any) -> None:
    if rt.device.type == "cuda":
        import torch

        torch.cuda.synchronize(rt.device)


def _run_steps(session: Any, opts: PreflightOptions, measured: Measured, progress: Progress) -> None:
    """`warmup` then `steps` optimizer steps, each timed; the memory peak after the first quarter of the measured
    steps and at the end. A run that diverges (too many non-finite steps in a row) stops there and says so."""
    from nanopt.train.schedule import lr_at
    from nanopt.train.step import TrainingDiverged, step

    memory, loader = session.memory, session.loader
    early_mark = max(1, opts.steps // 4)
    for index in range(opts.warmup + opts.steps):
        warming = index < opts.warmup
        if index == opts.warmup:  # the peak so far holds setup's own (imports, building the model)
            measured.peak_bytes = memory.peak()
            memory.reset()
            _collect_garbage()
        lr = lr_at(session.state.step, session.total_steps, session.run.train)
        loader.take()
        started = time.perf_counter()
        try:
            loss = step(session)[0]
        except TrainingDiverged as exc:  # decided on every rank together
            loss, measured.diverged = math.nan, exc.message
        _synchronize(session.rt)
        seconds = time.perf_counter() - started
        if warming:
            measured.warmup_s.append(seconds)
            progress("warmup", index + 1, opts.warmup)
        else:
            measured.step_s.append(seconds)
            measured.loader_wait_s += loader.take()
            measured.losses.append(loss)
            measured.lrs.append(lr)
            if len(measured.step_s) == early_mark:
                measured.early_peak_bytes = memory.peak()
            progress("steps", len(measured.step_s), opts.steps)
        if measured.diverged:
            break
    measured.end_peak_bytes = memory.peak()
    measured.peak_bytes = max(measured.peak_bytes, measured.end_peak_bytes)
    measured.skipped_steps = session.state.skipped_steps
    measured.chance_loss = math.log(session.run.model.vocab_size)


def _measure_eval_and_checkpoint(session: Any, measured: Measured, progress: Progress) -> None:
    """Two in-loop evaluations (the first pays once for what every later one reuses, such as the compiled
    evaluation graph), then one checkpoint."""
    if session.run.train.eval_interval:
        progress("evaluation", 0, 2)
        _collect_garbage()
        measured.eval_first_s = _time_evaluation(session)
        progress("evaluation", 1, 2)
        measured.eval_s = _time_evaluation(session)
    progress("checkpoint", 0, 1)
    _collect_garbage()
    measured.checkpoint_s = _time_checkpoint(session)


def _collect_garbage() -> None:
    """A full garbage collection before a measurement, outside it. One falls every so often in any process and
    costs one step, evaluation or save its fraction of a second; in a process forked from a warm parent the first
    one also copies every page it touches. Inside a measurement of a few steps it would be taken for the step's
    own time, and then multiplied by the run's length."""
    import gc

    gc.collect()


def _time_evaluation(session: Any) -> float:
    """One in-loop evaluation as nanopt.train.loop.maybe_eval times it: the validation slice and the loss on every
    rank (the loss chart drawn after it is not part of it)."""
    from nanopt.evaluate.loss import evaluate_loss
    from nanopt.train.loop import validation_batches

    started = time.perf_counter()
    evaluate_loss(session.prepared.model, session.rt, validation_batches(session))
    _synchronize(session.rt)
    return time.perf_counter() - started


def _time_checkpoint(session: Any) -> float:
    """How long one checkpoint blocks the step, saved exactly as training saves it (nanopt.train.save: the state
    copied to host memory, then written in the background), into a scratch directory beside the run directory (the
    disk the run writes to) instead of the run's own, waited for, and removed afterwards whatever happens."""
    from nanopt.train.save import save_checkpoint, wait_for_save, wait_quietly

    own = session.run
    scratch = _scratch_directory(session)
    if scratch is not None:
        session.run = replace(own, run_dir=scratch)
    try:
        blocked = save_checkpoint(session)
        wait_for_save(session)
        return blocked
    finally:
        wait_quietly(session)  # after an error: the background writer must not write into a removed directory
        session.run = own
        if scratch is not None:
            remove_tree(scratch, inside=scratch.parent, quiet=True)


def _scratch_directory(session: Any) -> Path | None:
    """A new directory beside the run directory on rank 0 (None on the others, which write nothing); a failure
    to make it is raised on every rank together, before the checkpoint's collectives."""
    from nanopt.runtime import broadcast_object

    run_dir, scratch, problem = session.run.run_dir, None, None
    if session.rt.is_main:
        try:
            scratch = Path(tempfile.mkdtemp(dir=Path(run_dir).resolve().parent, prefix=".preflight-"))
        except OSError as exc:
            problem = f"cannot make a scratch directory beside {run_dir}: {exc.strerror or exc}"
    problem = broadcast_object(session.rt, problem)
    if problem:
        raise NanoptError(problem, f"make the directory holding {run_dir} writable: preflight times a checkpoint "
                                   "there, on the disk the run will write to")
    return scratch


def _worst_of_ranks(rt: Any, m: Measured) -> Measured:
    """The slowest rank's times and the worst rank's memory and loader figures, the same on every rank (the ranks
    wait for each other at every step, and every rank must fit and be fed)."""
    if not rt.distributed:
        return m
    from nanopt.runtime import all_reduce_max

    def worst(value: float) -> float:
        return all_reduce_max(rt, value)

    mean = m.mean_step_s
    scale = worst(mean) / mean
    share = worst(m.loader_wait_share)
    return replace(
        m, setup_s=worst(m.setup_s), warmup_s=[s * scale for s in m.warmup_s], step_s=[s * scale for s in m.step_s],
        loader_wait_s=share * sum(m.step_s) * scale,
        peak_bytes=int(worst(m.peak_bytes)), early_peak_bytes=int(worst(m.early_peak_bytes)),
        end_peak_bytes=int(worst(m.end_peak_bytes)),
        eval_s=worst(m.eval_s) if m.eval_s is not None else None,
        eval_first_s=worst(m.eval_first_s) if m.eval_first_s is not None else None,
        checkpoint_s=worst(m.checkpoint_s))


# ---------------------------------------------------------------------------------------------- the report


def _report(run: RunConfig, rt: Any, opts: PreflightOptions, m: Measured) -> dict[str, Any]:
    from nanopt.runtime import device_name

    device = {"name": device_name(rt.device), "kind": _device_kind(rt), "world_size": rt.world_size}
    step_s = m.mean_step_s
    tokens_per_s = run.train.global_batch_tokens / step_s
    throughput = _throughput(run, rt, tokens_per_s)
    projection = _projection(run, rt, opts, m, step_s)
    checks = _checks(m)
    now = time.time()
    report = {
        "version": FORMAT_VERSION,
        "time": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "unix_time": round(now, 3), "run": str(run.run_dir), "device": device, "precision": rt.precision,
        "compile": _compiled(run, rt), "micro_batch": m.micro_batch, "grad_accum": run.grad_accum_steps(rt.world_size),
        "steps": {"warmup": len(m.warmup_s), "measured": len(m.step_s)},
        "step_time_s": step_s, "tokens_per_s": tokens_per_s, **throughput,
        "loader_wait_share": m.loader_wait_share,
        "memory": {"peak_bytes": m.peak_bytes, "early_peak_bytes": m.early_peak_bytes,
                   "end_peak_bytes": m.end_peak_bytes, "growth": m.memory_growth, "measure": _memory_measure(rt)},
        "losses": _losses(m),
        "eval_s": m.eval_s, "eval_first_s": m.eval_first_s, "checkpoint_s": m.checkpoint_s, "setup_s": m.setup_s,
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
    from nanopt.train.parallel import resolve_compile

    return resolve_compile(run.train.compile, rt.device)


def _memory_measure(rt: Any) -> str:
    return ("peak reserved GPU memory plus the CUDA context" if rt.device.type == "cuda"
            else "peak resident memory of the process")


def _throughput(run: RunConfig, rt: Any, tokens_per_s: float) -> dict[str, Any]:
    """MFU against the device's dense peak (nanopt.runtime.device_peak_flops); on a CPU, against the peak
    `nanopt estimate --gpu cpu` works out for this machine, so the two compare (all ranks share its cores)."""
    from nanopt.hardware import cpu_peak
    from nanopt.model.flops import flops_per_token, mfu, mfu_note
    from nanopt.runtime import device_peak_flops

    peak, source = device_peak_flops(rt.device, rt.precision)
    devices = rt.world_size
    if peak is None and rt.device.type != "cuda":
        found = cpu_peak()
        if found is not None:
            peak, source, devices = found.flops, found.describe(), 1
    utilization = mfu(tokens_per_s, flops_per_token(run.model, run.seq_len), devices, peak)
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


def _projection(run: RunConfig, rt: Any, opts: PreflightOptions, m: Measured, step_s: float) -> dict[str, Any]:
    """The whole run's time per phase at the measured durations, and its cost at the run's price."""
    from nanopt.runtime import device_price
    from nanopt.train.phases import occasions, projected_seconds

    seconds = projected_seconds(run, 0, step_s, m.eval_s, m.checkpoint_s, m.setup_s)
    evals = occasions(run.train.eval_interval, 0, run.total_steps) if run.train.eval_interval else 0
    if evals and m.eval_first_s is not None and m.eval_s is not None:
        seconds["eval"] += m.eval_first_s - m.eval_s  # what the first evaluation pays once
    total = sum(seconds.values())
    price, price_source = device_price(rt.device, opts.price_per_hour if opts.price_per_hour is not None
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


def _checks(m: Measured) -> dict[str, dict[str, Any]]:
    return {"loss_falls": _loss_check(m), "memory_flat": _memory_check(m), "loader_wait_small": _loader_check(m)}


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


def _memory_check(m: Measured) -> dict[str, Any]:
    growth = m.memory_growth
    detail = (f"peak {_mib(m.early_peak_bytes)} after the first quarter of the measured steps, {_mib(m.end_peak_bytes)}"
              f" at the end ({100 * growth:+.1f}%, limit +{100 * MEMORY_GROWTH_LIMIT:.0f}%)")
    return {"ok": growth <= MEMORY_GROWTH_LIMIT, "detail": detail}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def _loader_check(m: Measured) -> dict[str, Any]:
    share = m.loader_wait_share
    return {"ok": share < LOADER_WAIT_LIMIT,
            "detail": f"{100 * share:.2f}% of the step time waiting for data (limit {100 * LOADER_WAIT_LIMIT:.0f}%)"}
