"""Resuming: which checkpoint a session continues from, whether today's settings allow it, and restoring it.

Three kinds of setting:
- free: logging, eval and checkpoint cadence, compile, activation checkpointing; they do not change the maths.
- allowed with --allow-changed: the learning-rate schedule, the budget, clipping, weight decay and the micro-batch
  size (the global batch stays); the micro-batch is free when the world size changed too, and a resume on a
  world size that cannot take train.json's lowers it by itself (nanopt.train.parallel.world_fit).
- the world size is free too: the loader's position is global (the same samples follow on any number of ranks)
  and either checkpoint layout reshards the optimizer state, so an elastic restart on fewer or more ranks needs
  no person. Exact: the data order and the state; not bitwise: the losses (sums reduced in another order), and
  dropout's random streams, which continue only on the same world size.
- never: the model, the dataset, seq_len, the global batch and the seed; the run would silently be another.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig, RunConfig, TrainConfig
from nanopt.errors import CheckpointError, ResumeError
from nanopt.files import make_dir
from nanopt.runtime import new_cpu_group, restarts
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.contents import DamagedState, state_values_problem
from nanopt.train.observe.metrics import iter_metrics
from nanopt.train.optim.lowbit import check_stored_moments, is_adamw8bit
from nanopt.train.parallel.wrap import (
    load_full_model_state,
    load_full_optimizer_state,
    load_sharded_state,
    sharded_state,
)
from nanopt.train.session import Session

# `data` is the path, free to change when the dataset moves: its contents are checked by data_fingerprint.
FREE = {"data", "eval_interval", "eval_tokens", "downstream_interval", "checkpoint_interval", "keep_checkpoints",
        "checkpoint_async", "log_interval", "health", "compile", "cuda_graphs", "bf16_weight_copies",
        "activation_checkpointing", "max_nonfinite_steps", "spike_threshold", "price_per_hour", "on_exit",
        "on_exit_timeout_s", "recovery", "recovery_confirm_steps", "recovery_skip_steps", "recovery_lr_factor",
        "recovery_lr_steps", "max_recoveries", "tensorboard", "wandb_project", "wandb_mode", "data_epochs_warning"}
# The batch-warmup keys and the sequence-length stages place every step's samples (nanopt.config.batch_ramp,
# nanopt.config.seq_stages): changed, a checkpoint's step would point at other data.
NEVER = {"seq_len", "global_batch_tokens", "seed", "optimizer", "batch_warmup_tokens", "batch_warmup_start_tokens",
         "seq_len_stages"}

# The hint wherever checkpoints exist and none of them can be resumed.
NO_USABLE = ("move the damaged checkpoints aside and train again, or start over with --resume none (which moves them "
             "to previous/)")


def data_fingerprint(dataset: Any) -> str:
    """A hash of the dataset's shard checksums: the same path re-tokenized differently is another dataset."""
    splits = dataset.meta.get("splits", dataset.meta)
    return hashlib.sha256(json.dumps(splits, sort_keys=True, default=str).encode()).hexdigest()[:16]


# What a key a checkpoint does not name meant when it was written: nanopt gained the key later, with its default.
_DEFAULTS = {section: {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
             for section, cls in (("model", ModelConfig), ("train", TrainConfig))}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    diffs = []
    for section in ("model", "train"):
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            before = old.get(key, _DEFAULTS[section].get(key))  # a checkpoint older than the key: its default
            if before != new.get(key):
                diffs.append((f"{section}.{key}", before, new.get(key)))
    return diffs


def check_resumable(meta: dict[str, Any], run: RunConfig, fingerprint: str,
                    allow_changed: bool, tokenizer_sha256: str | None = None, world_size: int | None = None) -> None:
    if meta.get("weights_only") is True:
        _check_weights_only_start(meta, run, tokenizer_sha256)
        return
    free = FREE
    if meta.get("world_size", world_size) != world_size:
        # Another world size already reorders the sums; the micro-batch it may force (train.world_fit) is free too.
        free = FREE | {"micro_batch_size"}
    diffs = [d for d in config_differences(meta["config"], run.snapshot()) if d[0].split(".", 1)[1] not in free]
    if meta.get("data_fingerprint") not in (None, fingerprint):
        diffs.append(("data (dataset contents)", meta.get("data_fingerprint"), fingerprint))
    if not diffs:
        return
    listing = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diffs)
    never = [d for d in diffs if d[0].startswith("model.") or d[0].split(".", 1)[-1] in NEVER
             or d[0].startswith("data ")]
    if never:
        raise ResumeError(f"cannot resume: the checkpoint was made with other settings ({listing})",
                          "restore the original settings, or start a new run directory (or --resume none)")
    if not allow_changed:
        raise ResumeError(f"resuming with changed settings ({listing})",
                          "pass --allow-changed if this is intended (e.g. a new learning rate or a longer run)")


def _check_weights_only_start(meta: dict[str, Any], run: RunConfig, tokenizer_sha256: str | None) -> None:
    """A weights-only checkpoint (`nanopt import`'s) carries no training session: every train.json setting is the
    user's to choose. The model must be the one the weights are for, and the dataset must be tokenized with the
    tokenizer the weights learnt: token ids of another tokenizer would train on nonsense without any error."""
    diffs = [d for d in config_differences(meta["config"], run.snapshot()) if d[0].startswith("model.")]
    if diffs:
        listing = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diffs)
        raise ResumeError(f"cannot start from the imported weights: model.json changed since the import ({listing})",
                          "restore model.json (its shapes are the imported model's), or import again")
    recorded = meta.get("tokenizer_sha256")
    if recorded is not None and tokenizer_sha256 is not None and recorded != tokenizer_sha256:
        raise ResumeError(f"the dataset was tokenized with another tokenizer than the imported model's (tokenizer.json "
                          f"sha256 {tokenizer_sha256[:12]}, the model's {recorded[:12]})",
                          "tokenize the corpus with --tokenizer RUN/checkpoints/step-000000/tokenizer.json")


def maybe_resume(s: Session) -> None:
    """Restore the session from the checkpoint `--resume` names, or start from scratch."""
    found = _start_fresh(s) if s.opts.resume == "none" else _find_checkpoint(s)
    if found is None:
        if s.opts.resume != "none":
            s.metrics.truncate_after(0)
        return
    found = _load_usable(s, found)
    _restore_spike_history(s, found.step)
    if found.step < s.total_steps:  # a complete run writes nothing: it may sit on a full or read-only disk
        s.metrics.truncate_after(found.step)
        restart = {"restart": restarts().done} if restarts().done else {}  # torchrun restarted the ranks
        s.metrics.write("event", step=found.step, event="resume", checkpoint=found.path.name, **restart)
    s.observer.note(f"resumed from {found.path} (step {found.step}, {found.meta['tokens']:,} tokens)")
    if found.meta.get("world_size", s.rt.world_size) != s.rt.world_size:  # weights-only: no world size
        s.observer.note(f"the checkpoint was written by {found.meta['world_size']} rank(s), this run has "
                        f"{s.rt.world_size}: the data continues at the same sample and the optimizer state is "
                        "resharded; losses may differ in the last digits (sums reduced in another order)")


def _load_usable(s: Session, found: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """Load `found`, or, with --resume auto, when its optimizer state's values turn out damaged as they are read,
    the newest valid checkpoint before it: skipped with a note, as one that fails verification is. Loading
    overwrites every weight, moment and counter, so what the damaged one had already put in place is gone."""
    while True:
        check_resumable(found.meta, s.run, data_fingerprint(s.dataset), s.opts.allow_changed,
                        s.dataset.tokenizer_sha256, s.rt.world_size)
        try:
            load_checkpoint(s, found)
            return found
        except DamagedState as exc:
            if s.opts.resume != "auto":
                raise
            older, skipped = ckpt.newest_valid(s.run.run_dir, below=found.step)
            if older is None:  # as _find_checkpoint: never start over on top of checkpoints
                raise CheckpointError(f"{s.run.run_dir}: no usable checkpoint: {exc.message}", NO_USABLE) from None
            for note in (exc.message, *skipped):
                s.observer.note(f"skipping a damaged checkpoint: {note}")
            found = older


def load_checkpoint(s: Session, found: ckpt.Checkpoint) -> None:
    """Put a live session back to `found`: weights, optimizer moments, counters, loader position and RNGs (on
    resume, and on an automatic rollback: nanopt.train.guard.recovery). Either layout, written on any world size: each
    rank reads the part it holds now. A weights-only checkpoint restores the weights alone: the optimizer
    and the train state stay as a fresh session made them (step 0)."""
    if found.meta.get("weights_only") is True:
        load_full_model_state(s.prepared, ckpt.load_model_state(found))
        return
    if found.layout == ckpt.SHARDED:
        _load_sharded(s, found)
    else:
        load_full_model_state(s.prepared, ckpt.load_model_state(found))
        optimizer = ckpt.load_optimizer_state(found)
        _refuse_damaged(found, state_values_problem(optimizer["state"], found.step))  # every rank reads it all
        load_full_optimizer_state(s.prepared, s.optimizer, optimizer)
    s.train_state.load_state_dict(found.meta, s.rt.rank, s.rt.world_size)


def _refuse_damaged(found: ckpt.Checkpoint, problem: str | None) -> None:
    if problem:
        raise DamagedState(f"{found.path}: its optimizer state holds values no optimizer writes ({problem})",
                           "use another checkpoint")


def _load_sharded(s: Session, found: ckpt.Checkpoint) -> None:
    """DCP fills this rank's own tensors (the session's state as a template) with their part of the checkpoint;
    the optimizer's param groups come from meta.json."""
    template = sharded_state(s.prepared, s.optimizer)
    if s.rt.distributed and s.checkpoint_group is None:
        s.checkpoint_group = new_cpu_group(s.rt)
    filled = sharded.tensors_only(template)
    if is_adamw8bit(s.optimizer):
        check_stored_moments(filled["optimizer"], set(sharded.stored_specs(found.path)), str(found.path),
                             s.rt.world_size)
    sharded.load(filled, found.path, s.checkpoint_group)
    _refuse_damaged(found, _agreed(s, state_values_problem(filled["optimizer"]["state"], found.step)))
    optimizer = {"state": filled["optimizer"]["state"], "param_groups": found.meta["optimizer_param_groups"]}
    load_sharded_state(s.prepared, s.optimizer, {"model": filled["model"], "optimizer": optimizer})


def _agreed(s: Session, problem: str | None) -> str | None:
    """The first rank's problem, on every rank: each checked only the part it read, and all must skip together
    (a rank resuming alone would wait for the others in its first collective)."""
    if not s.rt.distributed:
        return problem
    import torch.distributed as dist

    problems: list[str | None] = [None] * s.rt.world_size
    dist.all_gather_object(problems, problem, group=s.checkpoint_group)
    return next((found for found in problems if found), None)


def _start_fresh(s: Session) -> ckpt.Checkpoint | None:
    """Move an earlier run's checkpoints and metrics aside (rank 0), so that nothing of it can be taken for this
    run's: neither by `nanopt train` resuming after a crash, nor by eval, nor by retention. Nothing is deleted.

    `--resume none` is this run again from its beginning, and an imported run begins at the imported weights
    (`nanopt import`'s step 0): that checkpoint stays where it is and is returned, verified, to start from. Every
    rank finds it on its own; rank 0 never moves it, so no rank races rank 0's renames."""
    imported = _imported_start(s)
    found = None if imported is None else _verified_import(imported)  # before anything moves: a refusal moves nothing
    if s.rt.is_main:
        _move_aside(s, keep=imported)
    return found


def _verified_import(path: Path) -> ckpt.Checkpoint:
    try:
        return ckpt.verify_discovered(path)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot start again from the imported weights: {exc.message}",
                              "import the model again (into a new run directory)") from None


def _imported_start(s: Session) -> Path | None:
    """The run's imported model: its oldest checkpoint, when that is step 0 and `nanopt import`'s."""
    oldest = ckpt.complete_checkpoints(s.run.run_dir)[:1]
    if not oldest or ckpt.step_of(oldest[0]) != 0:
        return None
    try:
        return oldest[0] if ckpt.is_imported(ckpt.read_meta(oldest[0] / "meta.json")) else None
    except CheckpointError:
        return None


def _move_aside(s: Session, keep: Path | None) -> None:
    """The training outputs into previous/TIMESTAMP/; with `keep`, checkpoints/ stays and only its other entries
    (later checkpoints, the `latest` and `best` pointers) go, into previous/TIMESTAMP/checkpoints/."""
    paths = s.paths
    outputs = [path for path in paths.training_outputs() if keep is None or path != paths.checkpoints]
    earlier = [] if keep is None else sorted(path for path in paths.checkpoints.iterdir() if path != keep)
    if not outputs and not earlier:
        return
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = make_dir(make_dir(paths.previous) / stamp)  # a link or a file at previous/ is refused, never followed
    for path in outputs:  # rename moves a name, never what a link names (and check_run_dir refused links here)
        path.rename(aside / path.name)
    if earlier:
        checkpoints = make_dir(aside / paths.checkpoints.name)
        for path in earlier:
            path.rename(checkpoints / path.name)
    start = "from scratch" if keep is None else f"again from the imported weights ({keep.name})"
    s.observer.note(f"starting {start} (--resume none): the earlier checkpoints and metrics were moved to "
                    f"{aside} (delete it when you no longer need it)")


def _restore_spike_history(s: Session, step: int) -> None:
    """Give the spike monitor the losses logged before the checkpoint. A resume with a changed learning rate is
    when a spike is most likely, and a fresh monitor would be blind for its first `min_history` steps."""
    if s.spikes is None or not s.rt.is_main:  # only rank 0 reports spikes
        return
    for record in iter_metrics(s.run.run_dir):
        loss = record.get("loss")
        if record.get("kind") == "train" and record.get("step", 0) <= step and isinstance(loss, float):
            if math.isfinite(loss):
                s.spikes.history.append(loss)  # a bounded deque: the last `window` losses stay


def _find_checkpoint(s: Session) -> ckpt.Checkpoint | None:
    if s.opts.resume == "auto":
        found, skipped = ckpt.latest(s.run.run_dir)
        if found is None and skipped:  # checkpoints are there, none usable: never start over on top of them
            raise CheckpointError(f"{s.run.run_dir}: no usable checkpoint: {skipped[0]}", NO_USABLE)
        for note in skipped:
            s.observer.note(f"skipping a damaged checkpoint: {note}")
        return found
    return ckpt.resolve(s.run.run_dir, s.opts.resume)
