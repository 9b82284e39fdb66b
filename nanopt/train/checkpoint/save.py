"""Saving a session as a checkpoint while training goes on: a collective every rank enters.

The step is blocked only while the state is copied to host memory; the files are written in the background:
- one process: a thread writes the full layout (two safetensors files) and publishes the checkpoint;
- several ranks: every rank hands the shards it holds to DCP's asynchronous save (nanopt.train.checkpoint.sharded),
  which writes them in a thread; once all are written, rank 0 publishes. No rank ever gathers the whole model.
Publishing (nanopt.train.checkpoint.publish) renames the finished directory into place and then moves `latest`, so
a crash during a background save leaves `latest` on the previous complete checkpoint.

The host copy is kept between saves (reused, not allocated again); train.json's `checkpoint_async` false makes
every save wait for its files and free its copy, for machines short of host memory.

At most one save is in flight. The next save, the end of the run, a preemption and a rollback wait for it
(`wait_for_save`), and there every rank learns whether it succeeded on all of them. metrics.jsonl's checkpoint
event records how long the step was blocked (`blocked_s`), how long the checkpoint took to be complete
(`write_s`) and, for one process's checkpoint, the CPU seconds its background writer used (`writer_cpu_s`: on a CPU
run, seconds taken from the cores the steps use).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanopt.errors import CheckpointError, NanoptError
from nanopt.rundir import step_dir_name
from nanopt.runtime import all_gather_object, broadcast_object, new_cpu_group
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.resume import data_fingerprint
from nanopt.train.parallel.wrap import sharded_state, tied_aliases
from nanopt.train.session import Session


@dataclass
class PendingSave:
    step: int
    future: Future  # this rank's part written; on rank 0, the checkpoint published (its result: Published)
    blocked_s: float
    submitted: float  # time.perf_counter() when the step was released


@dataclass(frozen=True)
class Published:
    path: Path
    finished: float  # time.perf_counter()
    carries_tokenizer: bool
    writer_cpu_s: float | None = None  # the background writer's CPU seconds, where one thread wrote it all


def save_checkpoint(s: Session) -> float:
    """Start saving the session's state at this step; returns the seconds the step was blocked (waiting for the
    previous save included). CheckpointError on every rank when the previous save failed on any rank, or when
    the checkpoint cannot be started."""
    started = time.perf_counter()
    wait_for_save(s)
    st = s.state
    rank_states = all_gather_object(s.rt, s.train_state.rank_state_dict())
    tmp = _begin(s)
    state = sharded_state(s.prepared, s.optimizer)
    meta = {**_meta(s, rank_states), "optimizer_param_groups": state["optimizer"]["param_groups"]}
    best = st.val_step == st.step and st.last_val_loss == st.best_val_loss
    if s.rt.distributed:
        meta["layout"] = ckpt.SHARDED
        if s.checkpoint_group is None:
            s.checkpoint_group = new_cpu_group(s.rt)
        written = sharded.save_async(sharded.tensors_only(state), tmp, s.checkpoint_group, _stager(s))
        future = _in_background(_publish_after, s, st.step, written, meta, best) if s.rt.is_main else written
    else:
        meta["layout"] = ckpt.FULL
        staged = _host_copy(s, state)  # the step may change the weights as soon as this returns
        future = _in_background(_write_full_then_publish, s, st.step, tmp, staged, meta, best)
    s.pending_save = PendingSave(st.step, future, time.perf_counter() - started, time.perf_counter())
    st.last_checkpoint_step = st.step
    if not s.run.train.checkpoint_async:
        wait_for_save(s)
    return time.perf_counter() - started


def wait_for_save(s: Session) -> Published | None:
    """Wait for the save in flight (a collective); record it and return what was published (rank 0; None on the
    other ranks, or with nothing in flight); CheckpointError on every rank if it failed on any."""
    pending, s.pending_save = s.pending_save, None
    if pending is None:
        return None
    outcome: tuple[str, str] | None = None
    try:
        published = pending.future.result()
    except NanoptError as exc:  # a CheckpointError, or a link where the checkpoint goes (WritePathError)
        outcome = (exc.message, exc.hint)
    except BaseException as exc:  # DCP's own failure (a shard not written): a CheckpointException, a BaseException
        reason = sharded.save_failure(exc)
        if reason is None:
            raise
        outcome = (f"could not write checkpoint {step_dir_name(pending.step)}: {reason}",
                   "free disk space or fix permissions; earlier checkpoints and 'latest' are intact")
    outcomes = [o for o in all_gather_object(s.rt, outcome) if o is not None]
    if outcomes:
        if s.rt.is_main:
            ckpt.abandon(s.run.run_dir, pending.step)
        raise CheckpointError(*outcomes[0])
    if not s.rt.is_main:
        return None
    _record(s, pending, published)
    return published


def steps_lost_to_writing(s: Session, published: Published | None) -> float:
    """The seconds a save's background writing took from the steps: on a CPU its writer's CPU time, spent on the
    cores the steps use while they run. 0 on a GPU (the host writes beside its steps), for a save that waits for its
    files (its blocked time holds the writing), and where no one thread wrote it all."""
    if published is None or not published.writer_cpu_s:
        return 0.0
    return published.writer_cpu_s if s.rt.device.type == "cpu" and s.run.train.checkpoint_async else 0.0


def wait_quietly(s: Session, timeout_s: float = 60.0) -> None:
    """On the way out after an error: let this rank's part of a save in flight finish (no collective, nothing
    raised), so that a checkpoint already being written is not cut short."""
    pending = s.pending_save
    if pending is not None:
        try:
            pending.future.result(timeout=timeout_s)
        except BaseException as exc:  # the error that ended the run is the one to report (DCP's is a BaseException)
            if sharded.save_failure(exc) is None:
                raise


def _record(s: Session, pending: PendingSave, published: Published) -> None:
    write_s = published.finished - pending.submitted + pending.blocked_s
    blocked_s = pending.blocked_s if s.run.train.checkpoint_async else write_s  # without it the step waits for all
    cpu = {} if published.writer_cpu_s is None else {"writer_cpu_s": round(published.writer_cpu_s, 4)}
    lost = steps_lost_to_writing(s, published)
    if lost:
        s.clock.recharge(lost, "train", "checkpoint")
    s.metrics.write("event", step=pending.step, event="checkpoint", path=str(published.path),
                    blocked_s=round(blocked_s, 4), write_s=round(write_s, 4), **cpu)
    if not published.carries_tokenizer:
        s.observer.note(f"{published.path.name} does not carry the tokenizer: {s.dataset.tokenizer_path} changed "
                        "since training started; eval and export of it need --data with the original dataset")


def _begin(s: Session) -> Path:
    """Rank 0 makes the empty `.tmp-step-N/`; every rank learns whether it could before anyone writes into it."""
    problem, tmp = None, None
    if s.rt.is_main:
        try:
            tmp = ckpt.begin(s.run.run_dir, s.state.step)
        except NanoptError as exc:  # a full disk, or a link where the checkpoint goes
            problem = (exc.message, exc.hint)
    problem, tmp = broadcast_object(s.rt, (problem, tmp))
    if problem is not None:
        raise CheckpointError(*problem)
    return tmp


def _meta(s: Session, rank_states: list) -> dict[str, Any]:
    # The checkpoint carries the tokenizer (and its EOS id), so eval, export and sampling work once the training
    # dataset is gone, and its hash lets them refuse a dataset made with another tokenizer.
    meta = {**s.train_state.state_dict(rank_states), "world_size": s.rt.world_size,
            "tied": tied_aliases(s.prepared.raw), "config": s.run.snapshot(),
            "data_fingerprint": data_fingerprint(s.dataset), "tokenizer_sha256": s.dataset.tokenizer_sha256,
            "eos_id": s.dataset.eos_id, "device_type": s.rt.device.type}  # "cpu" / "cuda": what a device-hour was
    meta.pop("step")  # publish sets it
    return meta


def _stager(s: Session) -> Any:
    """The session's stager (nanopt.train.checkpoint.sharded.new_stager), made at its first save and kept: its host copy
    of the state is reused by every later save. The previous save is always complete before the next copy starts.
    None with checkpoint_async false: each save's copy is freed once written."""
    if not s.run.train.checkpoint_async:
        return None
    if s.checkpoint_stager is None:
        s.checkpoint_stager = sharded.new_stager(s.rt.device) or False  # False: this torch has none
    return s.checkpoint_stager or None


def _host_copy(s: Session, state: dict[str, Any]) -> dict[str, Any]:
    """A copy of every tensor in host memory (on the CPU too: training goes on changing the originals)."""
    stager = _stager(s)
    if stager is not None:
        return stager.stage(state)

    def copy(value: Any) -> Any:
        if torch.is_tensor(value):
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value

    return copy(state)


def _in_background(work: Any, *args: Any) -> Future:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanopt-checkpoint")
    future = executor.submit(work, *args)
    executor.shutdown(wait=False)  # the thread ends with its one job
    return future


def _write_full_then_publish(s: Session, step: int, tmp: Path, staged: dict[str, Any], meta: dict[str, Any],
                             best: bool) -> Published:
    cpu_started = time.thread_time()
    ckpt.write_full(s.run.run_dir, step, tmp, staged["model"], staged["optimizer"])
    published = _publish(s, step, meta, best)
    return dataclasses.replace(published, writer_cpu_s=time.thread_time() - cpu_started)


def _publish_after(s: Session, step: int, written: Future, meta: dict[str, Any], best: bool) -> Published:
    written.result()  # every rank's shards and the index are written and synced
    return _publish(s, step, meta, best)


def _publish(s: Session, step: int, meta: dict[str, Any], best: bool) -> Published:
    """Rank 0, in the background: publish, then `best` and retention (which never remove what `latest` or `best`
    name). `best` names only a checkpoint evaluated at its own step: a later one carries the best loss so far but
    other weights."""
    path = ckpt.publish(s.run.run_dir, step, meta, tokenizer=s.dataset.tokenizer_path)
    if best:
        ckpt.write_pointer(s.paths.checkpoints, "best", path.name)
    ckpt.apply_retention(s.run.run_dir, s.run.train.keep_checkpoints)
    return Published(path, time.perf_counter(), (path / ckpt.TOKENIZER_FILE).is_file())
