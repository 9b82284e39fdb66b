"""The training loop: setup, step, maybe_eval, maybe_checkpoint; single process, DDP or FSDP2 under torchrun.

Every decision that could make ranks diverge (skip a non-finite step, stop for preemption, evaluate, save) is
taken from values all-reduced over the ranks or from the step number alone, so every rank always enters the
same collectives.
"""

from __future__ import annotations

import errno
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanopt import checkpoint as ckpt
from nanopt.config import RunConfig
from nanopt.errors import CheckpointError, DataError, DistributedError, NanoptError
from nanopt.evaluate import evaluate_loss
from nanopt.flops import count_params, flops_per_token
from nanopt.metrics import (
    MetricsLog,
    SpikeMonitor,
    peak_flops_for,
    peak_memory_bytes,
    read_metrics,
    write_loss_chart,
)
from nanopt.optim import build_optimizer, lr_at, set_lr
from nanopt.parallel import (
    Prepared,
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    prepare,
)
from nanopt.resume import check_resumable, data_fingerprint
from nanopt.runtime import (
    Runtime,
    all_gather_object,
    all_reduce_sum_,
    broadcast_object,
    init_runtime,
    quiesce,
    rng_state,
    seed_everything,
    set_rng_state,
    shutdown,
)
from nanopt.train_display import Display


class TrainingDiverged(NanoptError):
    """Too many consecutive non-finite steps."""


@dataclass(frozen=True)
class TrainOptions:
    resume: str = "auto"  # auto | none | latest | best | PATH
    allow_changed: bool = False  # resume although learning-rate, budget or world-size settings changed
    live: bool = True  # the rich live display on rank 0 (log lines are printed either way)


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens: int = 0
    last_val_loss: float | None = None
    best_val_loss: float | None = None
    skipped_steps: int = 0
    consecutive_nonfinite: int = 0
    last_loss: float | None = None
    last_checkpoint_step: int = -1


@dataclass
class Session:
    run: RunConfig
    rt: Runtime
    opts: TrainOptions
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    loader: Any
    dataset: Any
    accum: int
    total_steps: int
    metrics: MetricsLog
    display: Display
    flops_per_token: int
    peak_flops: float | None
    peak_source: str
    state: TrainState = field(default_factory=TrainState)
    spikes: SpikeMonitor | None = None
    preempt_requested: bool = False


# Freeing a DDP / FSDP session destroys its gloo process group from a Python destructor that holds the GIL, and
# that destructor can join a gloo thread which needs the GIL: the process then hangs after a finished run. Under
# torchrun a finished session stays referenced here and the CLI leaves with os._exit (see nanopt.cli.app.main).
_keep_until_exit: list[Session] = []


def train(run: RunConfig, opts: TrainOptions | None = None) -> dict[str, Any]:
    """Train a run directory to its budget, resuming if asked; returns the end-of-run summary (on every rank)."""
    opts = opts or TrainOptions()
    rt = init_runtime(run.train.precision)
    try:
        session = setup(run, rt, opts)
        with _preemption_handler(session):
            try:
                summary = loop(session)
            except NanoptError:  # decided on every rank together (diverged, disk full), so all can still meet
                quiesce(rt)
                raise
            except RuntimeError as exc:
                if rt.distributed and _lost_peer(exc):
                    raise _peer_error(session, exc) from None
                raise
            except OSError as exc:  # metrics.jsonl and loss.png meet a full disk first: they are written most often
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS):
                    raise
                raise _disk_error(session, exc) from None
            quiesce(rt)
            if rt.distributed:
                _keep_until_exit.append(session)
            return summary
    finally:
        shutdown(rt)


def _lost_peer(exc: RuntimeError) -> bool:
    """A collective that failed because another rank died, hung past the timeout or dropped off the network."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or "gloo" in str(exc) or "NCCL" in str(exc)


def _peer_error(s: Session, exc: RuntimeError) -> DistributedError:
    detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    latest = ckpt.read_pointer(ckpt.checkpoints_dir(s.run.run_dir), "latest") or "none yet"
    return DistributedError(f"rank {s.rt.rank} lost contact with another rank at step {s.state.step} ({detail})",
                            f"another rank died or hung (its own error says why; the wait is capped by "
                            f"NANOPT_PG_TIMEOUT_S); complete checkpoints are kept (latest: {latest}): run the same "
                            "command to resume")


def _disk_error(s: Session, exc: OSError) -> NanoptError:
    latest = ckpt.read_pointer(ckpt.checkpoints_dir(s.run.run_dir), "latest") or "none yet"
    return NanoptError(f"could not write {exc.filename or 'into ' + str(s.run.run_dir)} at step {s.state.step}: "
                       f"{exc.strerror}", f"free disk space; complete checkpoints are kept (latest: {latest}): run "
                       "the same command to resume")


# ------------------------------------------------------------------------------------------------- setup


def setup(run: RunConfig, rt: Runtime, opts: TrainOptions) -> Session:
    """A training session, resumed per `opts.resume`, writing metrics and checkpoints into the run directory."""
    session = build_session(run, rt, opts, writes=True)
    if rt.is_main:
        ckpt.remove_stale_temporaries(run.run_dir)
    maybe_resume(session)
    _announce(session)
    return session


def build_session(run: RunConfig, rt: Runtime, opts: TrainOptions | None = None, *, writes: bool = False,
                  check_data_budget: bool = True) -> Session:
    """Dataset, model, parallel wrapping, optimizer and loader at step 0, exactly as training uses them.

    With writes=False nothing is written into the run directory: `find-batch` and `profile` measure the real
    training step through this without touching a run's metrics or checkpoints.
    """
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loader import TrainLoader, check_budget, check_compatible
    from nanopt.model import Transformer

    opts = opts or TrainOptions(resume="none", live=False)
    accum = run.grad_accum_steps(rt.world_size)
    dataset = TokenDataset.open(run.train.data)
    check_compatible(dataset, run.model.vocab_size)
    if check_data_budget:
        check_budget(dataset, "train", run.total_tokens)
    seed_everything(run.train.seed)
    prepared = prepare(Transformer(run.model), rt, run.train)
    optimizer = build_optimizer(prepared.raw, run.train, rt.device)
    loader = TrainLoader(dataset, "train", run.seq_len, run.train.micro_batch_size, accum, rt.rank,
                         rt.world_size, run.train.seed)
    peak, source = peak_flops_for(rt.device, rt.precision)
    return Session(
        run=run, rt=rt, opts=opts, prepared=prepared, optimizer=optimizer, loader=loader, dataset=dataset,
        accum=accum, total_steps=run.total_steps, metrics=MetricsLog(run.run_dir, rt.is_main and writes),
        display=Display(rt.is_main, opts.live), flops_per_token=flops_per_token(run.model, run.seq_len),
        peak_flops=peak, peak_source=source, spikes=SpikeMonitor(run.train.spike_threshold))


def maybe_resume(s: Session) -> None:
    if s.opts.resume == "none":
        if s.rt.is_main and ckpt.complete_checkpoints(s.run.run_dir):
            s.display.note("starting from scratch (--resume none); existing checkpoints are kept until "
                           "retention replaces them")
        s.metrics.truncate_after(0)
        return
    found = _find_checkpoint(s)
    if found is None:
        s.metrics.truncate_after(0)
        return
    check_resumable(found.meta, s.run, s.rt.world_size, data_fingerprint(s.dataset), s.opts.allow_changed)
    load_full_model_state(s.prepared, ckpt.load_model_state(found))
    load_full_optimizer_state(s.prepared, s.optimizer, ckpt.load_optimizer_state(found))
    ranks = found.meta["ranks"]
    s.loader.load_state_dict(ranks[min(s.rt.rank, len(ranks) - 1)]["loader"])
    if len(ranks) == s.rt.world_size:
        set_rng_state(ranks[s.rt.rank]["rng"])
    st = s.state
    st.step, st.tokens = found.step, int(found.meta["tokens"])
    st.best_val_loss = found.meta.get("best_val_loss")
    st.last_val_loss = found.meta.get("metrics", {}).get("val_loss")
    st.skipped_steps = int(found.meta.get("skipped_steps", 0))
    st.last_checkpoint_step = found.step
    s.metrics.truncate_after(found.step)
    _restore_spike_history(s, found.step)
    s.metrics.write("event", step=found.step, event="resume", checkpoint=found.path.name)
    s.display.note(f"resumed from {found.path} (step {found.step}, {found.meta['tokens']:,} tokens)")


def _restore_spike_history(s: Session, step: int) -> None:
    """Give the spike monitor the losses logged before the checkpoint. A resume with a changed learning rate is
    when a spike is most likely, and a fresh monitor would be blind for its first `min_history` steps."""
    if s.spikes is None or not s.rt.is_main:  # only rank 0 reports spikes
        return
    for record in read_metrics(s.run.run_dir):
        loss = record.get("loss")
        if record.get("kind") == "train" and record.get("step", 0) <= step and isinstance(loss, float):
            if math.isfinite(loss):
                s.spikes.history.append(loss)  # a bounded deque: the last `window` losses stay


def _find_checkpoint(s: Session) -> ckpt.Checkpoint | None:
    if s.opts.resume == "auto":
        found, skipped = ckpt.newest_valid(s.run.run_dir)
        for note in skipped:
            s.display.note(f"skipping a damaged checkpoint: {note}")
        return found
    return ckpt.resolve(s.run.run_dir, s.opts.resume)


def _announce(s: Session) -> None:
    params = count_params(s.run.model).total
    mfu_note = s.peak_source if s.peak_flops else f"MFU not reported ({s.peak_source})"
    s.display.note(
        f"{s.run.run_dir}: {params:,} parameters, {s.total_steps} steps of {s.run.train.global_batch_tokens:,} "
        f"tokens (micro-batch {s.run.train.micro_batch_size} x {s.run.seq_len} x {s.rt.world_size} rank(s) x "
        f"{s.accum} accumulation), {s.rt.device.type} {s.rt.precision}"
        f"{', compiled' if s.prepared.compiled else ''}{', FSDP' if s.prepared.fsdp else ''}; {mfu_note}")


# -------------------------------------------------------------------------------------------------- loop


def loop(s: Session) -> dict[str, Any]:
    started = time.perf_counter()
    tokens_at_start = s.state.tokens
    window = _Window(time.perf_counter(), s.state.tokens)
    if s.state.step >= s.total_steps:
        s.display.note(f"{s.run.run_dir} is already complete ({s.state.step} steps); raise train_tokens or "
                       "max_steps and pass --allow-changed to train further")
    s.display.start(s.total_steps, s.state.step)
    try:
        while s.state.step < s.total_steps:
            loss, norm, stop = step(s)
            window = maybe_log(s, loss, norm, window)
            paused = time.perf_counter()
            maybe_eval(s)
            maybe_checkpoint(s, force=stop)
            window.time += time.perf_counter() - paused  # tokens/s measures training steps only
            if stop:
                s.display.note(f"preempted: saved step {s.state.step}; run `nanopt train {s.run.run_dir}` to "
                               "continue exactly where it stopped")
                break
    finally:
        s.display.stop()
    return summarize(s, time.perf_counter() - started, s.state.tokens - tokens_at_start)


def step(s: Session) -> tuple[float, float, bool]:
    """One optimizer step over `accum` micro-batches; returns (mean loss over ranks, grad norm, stop?)."""
    st, cfg = s.state, s.run.train
    set_lr(s.optimizer, lr_at(st.step, s.total_steps, cfg))
    loss_sum = torch.zeros((), device=s.rt.device)
    for micro in range(s.accum):
        inputs, targets = s.loader.next_batch()
        _check_token_ids(s, inputs, targets)
        inputs = inputs.to(s.rt.device, non_blocking=True)
        targets = targets.to(s.rt.device, non_blocking=True)
        with s.prepared.gradient_sync(micro == s.accum - 1):
            with s.rt.autocast():
                loss = s.prepared.model(inputs, targets)
            (loss / s.accum).backward()
        loss_sum += loss.detach().float()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(s.prepared.raw.parameters(), max_norm, foreach=True)
    norm = _local(norm)
    # One all-reduce and one host sync per step: the mean loss, and whether any rank saw a non-finite
    # value or was asked to stop. Every rank then takes the same branch.
    bad = (~torch.isfinite(loss_sum) | ~torch.isfinite(norm)).float()
    stats = torch.stack([loss_sum / s.accum, bad, torch.tensor(float(s.preempt_requested), device=s.rt.device)])
    stats = all_reduce_sum_(s.rt, stats.double()).tolist()
    mean_loss, any_bad, any_stop = stats[0] / s.rt.world_size, stats[1] > 0, stats[2] > 0
    if any_bad:
        _skip_nonfinite(s, mean_loss, float(norm))
    else:
        s.optimizer.step()
        st.consecutive_nonfinite = 0
    s.optimizer.zero_grad(set_to_none=True)
    st.step += 1
    st.tokens += cfg.global_batch_tokens
    st.last_loss = mean_loss
    return mean_loss, float(norm), any_stop


def _check_token_ids(s: Session, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """An id past the embedding table (a shard that no longer matches meta.json) would crash the step, on CUDA as
    a device-side assert; say which data is wrong instead. Two reductions over CPU tensors per micro-batch."""
    top = max(int(inputs.max()), int(targets.max()))
    if top >= s.run.model.vocab_size:
        raise DataError(f"{s.dataset.path}: the train split holds token id {top:,} at step {s.state.step + 1}, "
                        f"outside the model's vocab_size {s.run.model.vocab_size:,} (meta.json says "
                        f"{s.dataset.vocab_size:,})", f"a shard changed after tokenizing (meta.json has each shard's "
                        f"sha256); re-create the dataset: `nanopt tokenize SOURCE --out {s.dataset.path} --force`")


def _local(norm: torch.Tensor) -> torch.Tensor:
    """FSDP2 returns the (already global) norm as a DTensor; use its local value."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _skip_nonfinite(s: Session, loss: float, norm: float) -> None:
    st = s.state
    st.skipped_steps += 1
    st.consecutive_nonfinite += 1
    s.metrics.write("event", step=st.step + 1, event="nonfinite_skipped", loss=loss, grad_norm=norm)
    s.display.note(f"step {st.step + 1}: non-finite loss or gradient (loss {loss}, grad norm {norm}); "
                   f"optimizer step skipped ({st.consecutive_nonfinite} in a row)")
    if st.consecutive_nonfinite >= s.run.train.max_nonfinite_steps:
        raise TrainingDiverged(
            f"training diverged: {st.consecutive_nonfinite} non-finite steps in a row at step {st.step + 1}",
            f"resume from the last checkpoint with a lower learning rate, e.g. `nanopt train {s.run.run_dir} "
            f"--set learning_rate={s.run.train.learning_rate / 2:g} --allow-changed`")


@dataclass
class _Window:
    time: float
    tokens: int


def maybe_log(s: Session, loss: float, norm: float, window: _Window) -> _Window:
    st = s.state
    spike = s.spikes.check(loss) if s.spikes else None
    if spike is not None:
        s.metrics.write("event", step=st.step, event="loss_spike", loss=loss, zscore=spike)
        s.display.note(f"step {st.step}: loss spike {loss:.4f} ({spike:.1f} standard deviations above the mean)")
    if st.step % s.run.train.log_interval and st.step != s.total_steps:
        s.display.advance(st.step)
        return window
    now = time.perf_counter()
    elapsed = max(now - window.time, 1e-9)
    tokens_per_s = (st.tokens - window.tokens) / elapsed
    mfu = tokens_per_s * s.flops_per_token / (s.rt.world_size * s.peak_flops) if s.peak_flops else None
    record = {"step": st.step, "tokens": st.tokens, "loss": loss, "lr": s.optimizer.param_groups[0]["lr"],
              "grad_norm": norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
              "step_time_s": elapsed / max(1, (st.tokens - window.tokens) // s.run.train.global_batch_tokens),
              "peak_memory_bytes": peak_memory_bytes(s.rt.device)}
    s.metrics.write("train", **record)
    s.display.log(record, st.last_val_loss, s.total_steps)
    return _Window(now, st.tokens)


def maybe_eval(s: Session) -> None:
    from nanopt.data.loader import eval_batches

    interval, st = s.run.train.eval_interval, s.state
    due = interval and (st.step % interval == 0 or st.step == s.total_steps)
    if not due:
        return
    batches = eval_batches(s.dataset, "val", s.run.seq_len, s.run.train.micro_batch_size, s.rt.rank,
                           s.rt.world_size, s.run.train.eval_tokens)
    result = evaluate_loss(s.prepared.model, s.rt, batches)
    st.last_val_loss = result.loss
    improved = st.best_val_loss is None or result.loss < st.best_val_loss
    if improved:
        st.best_val_loss = result.loss
    s.metrics.write("eval", step=st.step, tokens=st.tokens, val_loss=result.loss, val_tokens=result.tokens,
                    val_perplexity=result.perplexity)
    s.display.eval(st.step, result.loss)
    if s.rt.is_main:
        write_loss_chart(s.run.run_dir)


def maybe_checkpoint(s: Session, force: bool = False) -> None:
    st, interval = s.state, s.run.train.checkpoint_interval
    due = force or st.step == s.total_steps or (interval and st.step % interval == 0)
    if not due or st.last_checkpoint_step == st.step:
        return
    if st.consecutive_nonfinite:
        # The weights that just gave a non-finite step would become `latest`, and resuming from them (as the
        # divergence hint says) would diverge again: keep the last good checkpoint instead. Every rank skips.
        s.metrics.write("event", step=st.step, event="checkpoint_skipped", reason="nonfinite")
        s.display.note(f"step {st.step}: checkpoint not saved after a non-finite step; the last good one is kept")
        return
    save_checkpoint(s)


def save_checkpoint(s: Session) -> None:
    """Collective: gather full state and every rank's loader/RNG state; rank 0 writes; all learn the outcome."""
    model_state = full_model_state(s.prepared)
    optimizer_state = full_optimizer_state(s.prepared, s.optimizer)
    ranks = all_gather_object(s.rt, {"loader": s.loader.state_dict(), "rng": rng_state()})
    outcome = None
    if s.rt.is_main:
        outcome = _write(s, model_state, optimizer_state, ranks)
    outcome = broadcast_object(s.rt, outcome)
    if outcome is not None:
        raise CheckpointError(*outcome)
    s.state.last_checkpoint_step = s.state.step


def _write(s: Session, model_state: dict, optimizer_state: dict, ranks: list) -> tuple[str, str] | None:
    st = s.state
    weights, tied = ckpt.dedupe_tied(model_state)
    meta = {"tokens": st.tokens, "world_size": s.rt.world_size, "ranks": ranks, "tied": tied,
            "config": s.run.snapshot(), "data_fingerprint": data_fingerprint(s.dataset),
            "best_val_loss": st.best_val_loss, "skipped_steps": st.skipped_steps,
            "metrics": {"train_loss": st.last_loss, "val_loss": st.last_val_loss}}
    try:
        path = ckpt.write_checkpoint(s.run.run_dir, st.step, weights, optimizer_state, meta)
    except CheckpointError as exc:
        return exc.message, exc.hint
    root = ckpt.checkpoints_dir(s.run.run_dir)
    if st.last_val_loss is not None and st.last_val_loss == st.best_val_loss:
        ckpt.write_pointer(root, "best", path.name)
    ckpt.apply_retention(s.run.run_dir, s.run.train.keep_checkpoints)
    s.metrics.write("event", step=st.step, event="checkpoint", path=str(path))
    return None


def summarize(s: Session, seconds: float, tokens: int) -> dict[str, Any]:
    st = s.state
    root = ckpt.checkpoints_dir(s.run.run_dir)
    tokens_per_s = tokens / max(seconds, 1e-9)
    summary = {
        "run": str(s.run.run_dir), "steps": st.step, "total_steps": s.total_steps, "tokens": st.tokens,
        "tokens_this_session": tokens, "seconds": seconds, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * s.flops_per_token / (s.rt.world_size * s.peak_flops) if s.peak_flops else None,
        "final_train_loss": st.last_loss, "final_val_loss": st.last_val_loss, "best_val_loss": st.best_val_loss,
        "skipped_steps": st.skipped_steps, "latest_checkpoint": ckpt.read_pointer(root, "latest"),
        "best_checkpoint": ckpt.read_pointer(root, "best"), "completed": st.step >= s.total_steps,
    }
    if s.rt.is_main and s.run.train.eval_interval:
        write_loss_chart(s.run.run_dir)
    return summary


class _preemption_handler:
    """SIGTERM / SIGINT set a flag; the next step's all-reduce makes every rank stop and save together."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.session.preempt_requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.session.preempt_requested = True
        self.session.display.note(f"received {signal.Signals(signum).name}: finishing this step, saving a "
                                  "checkpoint, then exiting (send it again to stop at once)")

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

