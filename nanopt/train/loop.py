"""`nanopt train`: set up a session, resume it, and run step -> log -> eval -> checkpoint to the budget.

Single process, or DDP / FSDP2 under torchrun. Every decision that could make ranks diverge (evaluate, save,
stop) is taken from the step number or from values all-reduced in the step, so every rank always enters the same
collectives.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import NanoptError, WritePathError
from nanopt.files import check_run_dir
from nanopt.model.flops import count_params, mfu, mfu_note
from nanopt.runtime import broadcast_object, init_runtime, quiesce, shutdown
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint.resume import maybe_resume
from nanopt.train.checkpoint.save import save_checkpoint, wait_for_save, wait_quietly
from nanopt.train.downstream import (
    downstream_advice,
    run_downstream,
    score_downstream,
    tasks_seconds_left,
    typical_eval_seconds,
)
from nanopt.train.guard.failures import reporting_failures
from nanopt.train.guard.lock import RunLock, RunLocked
from nanopt.train.guard.preemption import preemption_handler
from nanopt.train.guard.recovery import recover_if_needed, spike_pending, start_watching
from nanopt.train.guard.stall import StallWatch, start_stall_watch
from nanopt.train.health import watch as health_watch
from nanopt.train.mixture_report import (
    PhaseWatch,
    announce_sources,
    evaluate_sources,
    source_record,
    source_summary,
    warn_if_data_repeats,
)
from nanopt.train.observe import pace, phases
from nanopt.train.observe.events import TrainObserver
from nanopt.train.observe.metrics import iter_metrics, write_loss_chart
from nanopt.train.recompiles import CompileWatch
from nanopt.train.session import Session, TrainOptions, build_session
from nanopt.train.shape_schedule import stage_begins, stages_note, step_times, warmup_note
from nanopt.train.step import step
from nanopt.untrusted_text import shell_word

# Freeing a DDP / FSDP session destroys its gloo process group from a Python destructor that holds the GIL, and
# that destructor can join a gloo thread which needs the GIL: the process then hangs after a finished run. Under
# torchrun a finished session stays referenced here and the CLI leaves with os._exit (see nanopt.cli.app.main).
_keep_until_exit: list[Session] = []


def train(run: RunConfig, opts: TrainOptions | None = None,
          observer: TrainObserver | None = None) -> dict[str, Any]:
    """Train a run directory to its budget, resuming if asked; returns the end-of-run summary (on every rank)."""
    opts = opts or TrainOptions()
    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    lock = RunLock(run.run_dir)
    crashed = False
    try:
        _lock_on_rank0(rt, lock)
        session = reporting_failures(run, rt, lambda: setup(run, rt, opts, observer))
        with preemption_handler(session):
            summary = reporting_failures(run, rt, lambda: loop(session), session)
            quiesce(rt)
            if rt.distributed:
                _keep_until_exit.append(session)
            return summary
    except BaseException as exc:
        crashed = not isinstance(exc, (NanoptError, KeyboardInterrupt, SystemExit))
        raise
    finally:
        lock.release()
        # A crash (a bug) leaves the process group up: the other ranks notice this rank is gone only when the
        # process exits, after the CLI has handed its error to nanopt's launcher (nanopt.cli.app.main), which can
        # then name the crash instead of their lost contact.
        if not crashed:
            shutdown(rt)


def _lock_on_rank0(rt: Any, lock: RunLock) -> None:
    """Rank 0 checks every path training writes in the run directory (no links, a directory where one belongs:
    before anything is written, the lock included), then takes the lock; every rank learns the outcome, so all
    refuse together."""
    refusal = None
    if rt.is_main:
        try:
            check_run_dir(lock.path.parent)
            lock.acquire()
        except (RunLocked, WritePathError) as exc:
            refusal = (type(exc), exc.message, exc.hint)
    refusal = broadcast_object(rt, refusal)
    if refusal is not None:
        kind, message, hint = refusal
        raise kind(message, hint)


# ------------------------------------------------------------------------------------------------- setup


def setup(run: RunConfig, rt: Any, opts: TrainOptions, observer: TrainObserver | None = None) -> Session:
    """A training session, resumed per `opts.resume`, writing metrics and checkpoints into the run directory.

    Everything that can be checked before the first step is checked here, so a mistake costs no training: the
    validation split must hold one window of seq_len + 1 tokens when in-loop evaluation is on."""
    session = build_session(run, rt, opts, writes=True, observer=observer)
    if run.train.eval_interval:
        validation_batches(session)
    if rt.is_main:
        ckpt.remove_stale_temporaries(run.run_dir)
    maybe_resume(session)
    start_watching(session)  # after the resume, which restores the losses from before its checkpoint
    health_watch.start_health(session)
    if rt.is_main:  # after the resume, which drops the records of steps it will run again but never phase records
        session.earlier = phases.newest_per_session(iter_metrics(run.run_dir))
    _announce(session)
    pace.announce(session)  # the CPU's threads, after the start-up line (a resume's errors come before both)
    if not announce_sources(session):  # a mixture tells of each source instead
        warn_if_data_repeats(session)
    return session


def _announce(s: Session) -> None:
    params = count_params(s.run.model).total
    mfu_note = s.peak_source if s.peak_flops else f"MFU not reported ({s.peak_source})"
    s.observer.note(
        f"{s.run.run_dir}: {params:,} parameters, {s.total_steps} steps of {s.run.train.global_batch_tokens:,} "
        f"tokens (micro-batch {s.run.train.micro_batch_size} x {s.run.seq_len} x {s.rt.world_size} rank(s) x "
        f"{s.accum} accumulation){warmup_note(s.run.train)}{stages_note(s.run, s.prepared.compiled)}, "
        f"{s.rt.device.type} {s.rt.precision}"
        f"{' without TF32' if s.rt.device.type == 'cuda' and not s.rt.tf32 else ''}"
        f"{', compiled' if s.prepared.compiled else ''}{', FSDP' if s.prepared.fsdp else ''}; {mfu_note}")


# -------------------------------------------------------------------------------------------------- loop


@dataclass
class _Window:
    """The span since the last log line: tokens/s and step time are measured over it, pauses excluded."""

    time: float
    tokens: int


def loop(s: Session) -> dict[str, Any]:
    started = time.perf_counter()
    tokens_at_start = s.state.tokens
    window = _Window(time.perf_counter(), s.state.tokens)
    if s.state.step >= s.total_steps:
        s.observer.note(f"{s.run.run_dir} is already complete ({s.state.step} steps); raise train_tokens or "
                        "max_steps and pass --allow-changed to train further")
    s.observer.start(s.total_steps, s.state.step)
    s.clock.end_setup()
    # torch.compile compiles in the first step: that step's time is setup, not training.
    first_phase = "setup" if s.prepared.compiled else "train"
    warmed_up, watch, compiles, data_phases = False, None, CompileWatch(s), PhaseWatch(s)
    try:
        while s.state.step < s.total_steps:
            with s.clock.phase(first_phase), compiles.step(s, new_shape=first_phase == "setup"):
                loss, norm, stop = step(s)
            if not warmed_up:
                _freeze_heap()
                warmed_up, watch = True, start_stall_watch(s)  # after the first step, which may compile for long
            _beat(watch, s, "training")
            first_phase = "train"
            if recover_if_needed(s, loss):  # rolled back to a checkpoint: nothing of this step is kept
                window = _Window(time.perf_counter(), s.state.tokens)  # tokens/s from the checkpoint's count
                continue
            window = maybe_log(s, loss, norm, window)
            data_phases.after_step(s)  # before a checkpoint at this step, which then keeps its event
            paused = time.perf_counter()
            _beat(watch, s, "evaluation or checkpoint")
            _eval_keeping_the_checkpoint(s)
            maybe_checkpoint(s, force=stop)
            _beat(watch, s, "training")
            window.time += time.perf_counter() - paused  # tokens/s measures training steps only
            if stage_begins(s) and s.prepared.compiled:  # its new shape compiles in its first step: setup time
                first_phase = "setup"
            if stop:
                with s.clock.phase("checkpoint"):
                    wait_for_save(s)
                s.observer.note(f"preempted: saved step {s.state.step}; run `nanopt train "
                                f"{shell_word(s.run.run_dir)}` to continue exactly where it stopped")
                break
        with s.clock.phase("checkpoint"):
            wait_for_save(s)  # the run is not done until its last checkpoint is
    except BaseException:
        gc.unfreeze()
        wait_quietly(s)
        s.observer.stop()
        _record_phases(s, best_effort=True)
        s.metrics.close()  # TensorBoard / W&B finish here: a torchrun rank leaves with os._exit
        raise
    finally:
        if watch is not None:
            watch.stop()
    gc.unfreeze()  # the session's objects may be freed again once the caller lets go of them
    s.observer.stop()
    summary = summarize(s, time.perf_counter() - started, s.state.tokens - tokens_at_start)
    if summary["tokens_this_session"]:  # a session that found the run complete did nothing worth recording
        # After summarize's loss chart, so the record holds all but the session's last moments; best effort: a
        # finished run's checkpoints are safe, and a full disk now must not turn it into a failure.
        _record_phases(s, best_effort=True)
    s.metrics.close()
    summary["time"] = {**run_time_so_far(s).to_dict(), "price_per_hour": s.price_per_hour,
                       "price_source": s.price_source, "world_size": s.rt.world_size}
    return summary


def _beat(watch: StallWatch | None, s: Session, phase: str) -> None:
    if watch is not None:
        watch.beat(s.state.step, phase)


def _freeze_heap() -> None:
    """After the first (warm-up) step, move everything alive (model, optimizer, compiled code, torch's modules) into
    the garbage collector's permanent generation: full collections then walk only what later steps create, instead
    of pausing the host for hundreds of milliseconds while the GPU waits for work (nanochat measured such pauses).
    Collection stays on for the objects steps create; the loop unfreezes the heap when it ends."""
    gc.collect()
    gc.freeze()


def _record_phases(s: Session, best_effort: bool = False) -> None:
    """The session's time per phase so far, as a metrics.jsonl `phases` record (see nanopt.train.observe.phases). When
    the session is ending on an error, a failure to write it (the full disk that ended it) must not hide that."""
    try:
        s.metrics.write("phases", step=s.state.step, world_size=s.rt.world_size, price_per_hour=s.price_per_hour,
                        **s.clock.record())
    except OSError:
        if not best_effort:
            raise


def run_time_so_far(s: Session) -> phases.RunTime:
    """The run's time and money per phase: its earlier sessions (as recorded) and this one (as measured now), all
    at this session's price."""
    this = {"kind": "phases", "session_start": s.clock.started, "world_size": s.rt.world_size, **s.clock.record()}
    return phases.run_time([*s.earlier, this], price_per_hour=s.price_per_hour) or phases.RunTime()


def _eval_keeping_the_checkpoint(s: Session) -> None:
    """An evaluation that fails (bad validation data, every rank alike) must not cost the steps since the last
    checkpoint: save the checkpoint that is due (or one at this step), then report the failure."""
    try:
        maybe_eval(s)
    except NanoptError:
        maybe_checkpoint(s, force=True)
        wait_for_save(s)
        raise


def maybe_log(s: Session, loss: float, norm: float, window: _Window) -> _Window:
    st = s.state
    spike = s.spikes.check(loss) if s.spikes else None
    if spike is not None:
        s.metrics.write("event", step=st.step, event="loss_spike", loss=loss, zscore=spike)
        s.observer.note(f"step {st.step}: loss spike {loss:.4f} ({spike:.1f} standard deviations above the mean)")
    health_watch.after_step(s, loss, norm)
    if st.step % s.run.train.log_interval and st.step != s.total_steps:
        s.observer.advance(st.step)
        return window
    now = time.perf_counter()
    elapsed = max(now - window.time, 1e-9)
    tokens_per_s = (st.tokens - window.tokens) / elapsed
    utilization = mfu(tokens_per_s, s.flops_per_token, s.rt.world_size, s.peak_flops)
    step_s, full_step_s = step_times(s.run.train, elapsed, window.tokens, st.tokens)  # batch warmup's are shorter
    record = {"step": st.step, "tokens": st.tokens, "epoch": s.loader.epochs_at(st.step), "loss": loss,
              "lr": float(s.optimizer.param_groups[0]["lr"]), "grad_norm": norm, "tokens_per_s": tokens_per_s,
              "mfu": utilization, "mfu_note": mfu_note(utilization, s.peak_flops), "step_time_s": step_s,
              "peak_memory_bytes": s.memory.peak(), **source_record(s, st.step), **_time_and_money(s, full_step_s)}
    health_watch.on_log(s, record)  # its fields, and any verdict they newly show
    s.metrics.write("train", **record)
    s.observer.log(record, s.total_steps)
    pace.after_log(s, record, elapsed)
    return _Window(now, st.tokens)


def _time_and_money(s: Session, step_s: float) -> dict[str, Any]:
    """The live bill: the run's wall time and cost so far (every session), and the time and cost to finish: the
    steps, evaluations and checkpoints left at their latest durations, plus the session's share of other time so
    far (log lines, the loss chart, waiting)."""
    loss_eval_s, tasks_s = tasks_seconds_left(s)
    left = phases.projected_seconds(s.run, s.state.step, step_s, loss_eval_s, s.clock.last["checkpoint"])
    left["eval"] += tasks_s
    totals = s.clock.totals(s.clock.wall())
    worked = totals["train"] + totals["eval"] + totals["checkpoint"]
    eta = sum(left.values()) * (1 + totals[phases.OTHER] / worked if worked > 0 else 1)
    so_far = run_time_so_far(s)
    price, devices = s.price_per_hour, s.rt.world_size
    return {"elapsed_s": so_far.wall_seconds, "eta_s": eta, "spent_usd": so_far.cost_usd,
            "to_finish_usd": None if price is None else eta * devices * price / 3600}


def validation_batches(s: Session) -> Any:
    """The slice of the validation split in-loop evaluation reads (also what preflight times)."""
    from nanopt.data.mixtures.mixture import run_eval_batches

    return run_eval_batches(s.dataset, "val", s.run.seq_len, s.run.train.micro_batch_size, s.rt.rank,
                            s.rt.world_size, s.run.train.eval_tokens)


def maybe_eval(s: Session) -> None:
    interval, st = s.run.train.eval_interval, s.state
    due = interval and (st.step % interval == 0 or st.step == s.total_steps)
    if not due:
        return
    with s.clock.phase("eval"):
        batches = validation_batches(s)
        result, by_source = evaluate_sources(s, batches)
        st.last_val_loss, st.val_step = result.loss, st.step
        if st.best_val_loss is None or result.loss < st.best_val_loss:
            st.best_val_loss = result.loss
        tasks = score_downstream(s)  # charged to the eval phase too
    s.metrics.write("eval", step=st.step, tokens=st.tokens, val_loss=result.loss, val_tokens=result.tokens,
                    val_perplexity=result.perplexity, eval_s=s.clock.last["eval"], **by_source, **tasks)
    if s.rt.is_main:
        write_loss_chart(s.run.run_dir)
    s.observer.evaluated(st.step, result.loss, s.clock.last["eval"], _eval_share(s))
    _record_phases(s)
    _warn_if_eval_costly(s)


def _eval_share(s: Session) -> float:
    """Evaluation's share of this session's time in steps and evaluation."""
    spent = s.clock.seconds["eval"]
    return spent / max(spent + s.clock.seconds["train"], 1e-9)


def _warn_if_eval_costly(s: Session) -> None:
    """Once per session, say when evaluation takes more than phases.EVAL_SHARE_WARNING of the time of its interval
    (see phases.EvalShareWatch), with the eval_interval or eval_tokens that would bring it under."""
    eval_s, interval = typical_eval_seconds(s), s.run.train.eval_interval  # downstream tasks: see there
    costly = s.eval_watch.costly(s.state.step, s.clock.seconds["train"], eval_s or 0.0)
    if costly is None:
        return
    share, step_s = costly
    advice = phases.eval_advice(eval_s, step_s, s.run)
    s.metrics.write("event", step=s.state.step, event="eval_share", share=share, step_s=step_s, **advice)
    s.observer.note(f"step {s.state.step}: evaluation takes {share:.0%} of the step and evaluation time ("
                    f"{eval_s:.2f} s every {interval} steps of {step_s:.3f} s); "
                    f"eval_interval {advice['eval_interval']} or eval_tokens {advice['eval_tokens']:,} would bring "
                    f"it under {phases.EVAL_SHARE_WARNING:.0%} (--set KEY=VALUE; both may change on resume)"
                    f"{downstream_advice(s)}")


def maybe_checkpoint(s: Session, force: bool = False) -> None:
    st, interval = s.state, s.run.train.checkpoint_interval
    due = force or st.step == s.total_steps or (interval and st.step % interval == 0)
    if not due or st.last_checkpoint_step == st.step:
        return
    if st.consecutive_nonfinite:
        # The weights that just gave a non-finite step would become `latest`, and resuming from them (as the
        # divergence hint says) would diverge again: keep the last good checkpoint instead. Every rank skips.
        s.metrics.write("event", step=st.step, event="checkpoint_skipped", reason="nonfinite")
        s.observer.note(f"step {st.step}: checkpoint not saved after a non-finite step; the last good one is kept")
        return
    if spike_pending(s) and not (force or st.step == s.total_steps):  # the next interval saves, spike or not
        s.metrics.write("event", step=st.step, event="checkpoint_skipped", reason="spike")
        s.observer.note(f"step {st.step}: checkpoint not saved during a loss spike; the last good one is kept")
        return
    with s.clock.phase("checkpoint"):
        save_checkpoint(s)
    _record_phases(s)


def summarize(s: Session, seconds: float, tokens: int) -> dict[str, Any]:
    st = s.state
    root = s.paths.checkpoints
    tokens_per_s = tokens / max(seconds, 1e-9)
    utilization = mfu(tokens_per_s, s.flops_per_token, s.rt.world_size, s.peak_flops)
    summary = {
        "run": str(s.run.run_dir), "steps": st.step, "total_steps": s.total_steps, "tokens": st.tokens,
        "epochs": s.loader.epochs_at(st.step), "health": health_watch.summary(s),
        "tokens_this_session": tokens, "seconds": seconds, "tokens_per_s": tokens_per_s,
        "mfu": utilization, "mfu_note": mfu_note(utilization, s.peak_flops),
        "final_train_loss": st.last_loss, "final_val_loss": st.last_val_loss, "best_val_loss": st.best_val_loss,
        "skipped_steps": st.skipped_steps, "latest_checkpoint": ckpt.read_pointer(root, "latest"),
        "best_checkpoint": ckpt.read_pointer(root, "best"), "completed": st.step >= s.total_steps,
        "downstream": run_downstream(s),  # the latest downstream scores (train.json downstream_tasks), or None
        **source_summary(s, st.step),
    }
    if s.rt.is_main and s.run.train.eval_interval and tokens:  # nothing new to draw for a complete run
        write_loss_chart(s.run.run_dir)
    return summary
