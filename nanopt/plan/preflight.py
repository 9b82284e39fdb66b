"""`nanopt preflight`: a few dozen real optimizer steps of a run, on the machine (and ranks) that will train it,
checked and projected to the run's end in time and money, without touching the run.

The session is the one training builds (`nanopt.train.session.build_session`, writes=False): the same model, dtype,
compile, accumulation, parallelism, loader and schedule from step 0. Nothing of the run is written: no checkpoint,
no metrics.jsonl, no lock; one evaluation and one checkpoint are measured into a temporary directory beside the run
directory (same filesystem), removed afterwards whatever happens. Rank 0 writes `preflight.json` (atomically).
With `--find-batch`, the micro-batch comes from `nanopt find-batch`'s search, which also leaves its
find_batch.json, as that command does.

Time is measured as nanopt.train.observe.phases charges it: setup from the process start to the first step (and the
first step itself when compiled), the mean measured step, one in-loop evaluation and one
checkpoint save; `phases.projected_seconds` turns them into the run's time per phase.

The report and its checks are built by nanopt.plan.preflight_report; preflight.json's format is described, and the
file read, by nanopt.plan.preflight_record.

Imports nanopt.train (the session measured and its in-loop validation), nanopt.plan.find_batch,
nanopt.plan.preflight_report, nanopt.model, nanopt.runtime and the contracts. Torch is imported inside the
functions that run steps.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError, NanoptError
from nanopt.files import check_run_dir, remove_tree
from nanopt.hardware import MAX_SIZE_BYTES, check_price_per_hour
from nanopt.parsing import check_option, save_json
from nanopt.plan.preflight_report import Measured, build_report
from nanopt.rundir import RunDir

MAX_PREFLIGHT_STEPS = 10_000  # a preflight of more steps is a typo: it would be the run itself
# Without --steps: at least DEFAULT_STEPS measured steps and at least MIN_MEASURED_S of them (at most
# MAX_DEFAULT_STEPS). Thirty steps of a small model on a CPU are 2-5 s, which sample a shared machine's moment: on
# the project's 2-core machine 20-step windows of one run moved by 10-25%.
DEFAULT_STEPS = 30
MIN_MEASURED_S = 10.0
MAX_DEFAULT_STEPS = 1000

Progress = Callable[[str, int, int], None]  # (stage, done, total): setup, warmup, steps, evaluation, checkpoint


@dataclass(frozen=True)
class PreflightOptions:
    steps: int | None = None  # measured optimizer steps; None: DEFAULT_STEPS, more to fill MIN_MEASURED_S
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




def preflight(run: RunConfig, opts: PreflightOptions, on_progress: Progress | None = None,
              on_trial: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Measure the run, project it, save runs/NAME/preflight.json (rank 0) and return the report (every rank)."""
    from nanopt.runtime import init_runtime, shutdown

    opts.validate()
    check_run_dir(run.run_dir)  # preflight.json is written there at the end: a link there is refused now
    billed_from = opts.started if opts.started is not None else time.time()
    run, micro_batch, searching_s = _micro_batch(run, opts, on_trial)
    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    try:
        measured = _measure(run, rt, opts, billed_from + searching_s, micro_batch, on_progress or _silent)
        report = build_report(run, rt, opts.price_per_hour, measured)
        if rt.cpu_threads is not None:  # on the CPU the threads decide the step time measured: how many, and why
            report["device"]["cpu_threads"] = rt.cpu_threads.record()
        if run.mixture is not None:  # what each source of a mixture gives the run (nanopt.data.mixtures.mixture_plan)
            from nanopt.data.mixtures.mixture_plan import plan_records

            report["sources"], report["data_epochs_warning"] = plan_records(run), run.train.data_epochs_warning
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
    per_rank = int(run.sequences_per_rank(ranks().world_size))
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
    from nanopt.data.mixtures.mixture import open_run_data
    from nanopt.plan.profile import TimedLoader
    from nanopt.train.loop import validation_batches
    from nanopt.train.session import build_session
    from nanopt.train.shape_schedule import skip_the_ramp, skip_to_the_longest_stage

    progress("setup", 0, 1)
    session = build_session(run, rt, writes=False)
    skip_the_ramp(session)  # batch warmup: time the full-size steps that take most of the run
    skip_to_the_longest_stage(session)  # seq_len stages: the peak memory and the slowest step
    # Training hashes a dataset of up to 1 GiB whole when it opens it (writes=True); that is part of its setup.
    open_run_data(run)
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
    """`warmup` then `steps` optimizer steps (or steps_to_measure's), each timed; the memory peak after the first
    quarter of the measured steps and at the end. A run that diverges (too many non-finite steps in a row) stops
    there and says so."""
    from nanopt.train.optim.schedule import scheduled_lr
    from nanopt.train.step import TrainingDiverged, step

    memory, loader = session.memory, session.loader
    to_measure = early_mark = 0  # decided when the warmup has ended
    index = 0
    while index <= opts.warmup or len(measured.step_s) < to_measure:
        warming = index < opts.warmup
        if index == opts.warmup:  # the peak so far holds setup's own (imports, building the model)
            to_measure = opts.steps or steps_to_measure(session.rt, measured.warmup_s, session.total_steps)
            early_mark = max(1, to_measure // 4)
            measured.peak_bytes = memory.peak()
            memory.reset()
            _collect_garbage()
        lr = scheduled_lr(session.state.step, session.total_steps, session.run.train)
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
            progress("steps", len(measured.step_s), to_measure)
        if measured.diverged:
            break
        index += 1
    measured.end_peak_bytes = memory.peak()
    measured.peak_bytes = max(measured.peak_bytes, measured.end_peak_bytes)
    measured.skipped_steps = session.state.skipped_steps
    measured.chance_loss = math.log(session.dataset.id_limit)  # the padded vocabulary rows are never a class


def steps_to_measure(rt: Any, warmup_s: list[float], run_steps: int) -> int:
    """How many steps fill MIN_MEASURED_S at the last warmup step's pace: DEFAULT_STEPS at least, and no more than
    MAX_DEFAULT_STEPS or the run's own steps (DEFAULT_STEPS without a warmup to go by). The most any rank needs, so
    every rank runs the same steps."""
    from nanopt.runtime import all_reduce_max

    wanted = DEFAULT_STEPS if not warmup_s else math.ceil(MIN_MEASURED_S / max(warmup_s[-1], 1e-6))
    return int(all_reduce_max(rt, max(DEFAULT_STEPS, min(wanted, MAX_DEFAULT_STEPS, run_steps))))


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
    measured.checkpoint_blocked_s, measured.checkpoint_writer_cpu_s = _time_checkpoint(session)


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
    from nanopt.train.loop import validation_batches
    from nanopt.train.validation import evaluate_loss

    started = time.perf_counter()
    evaluate_loss(session.prepared.model, session.rt, validation_batches(session))
    _synchronize(session.rt)
    return time.perf_counter() - started


def _time_checkpoint(session: Any) -> tuple[float, float]:
    """What one checkpoint costs the steps: the seconds the save blocks the step, and those its background writing
    takes from them (nanopt.train.checkpoint.save.steps_lost_to_writing: on a CPU, 0 elsewhere). Saved exactly as
    training saves it (the state copied to host memory, then written in the background), into a scratch directory
    beside the run directory (the disk the run writes to) instead of the run's own, waited for, and removed
    afterwards whatever happens."""
    from nanopt.train.checkpoint.save import save_checkpoint, steps_lost_to_writing, wait_for_save, wait_quietly

    own = session.run
    scratch = _scratch_directory(session)
    if scratch is not None:
        session.run = replace(own, run_dir=scratch)
    try:
        blocked = save_checkpoint(session)
        return blocked, steps_lost_to_writing(session, wait_for_save(session))
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
        checkpoint_blocked_s=worst(m.checkpoint_blocked_s), checkpoint_writer_cpu_s=worst(m.checkpoint_writer_cpu_s))

