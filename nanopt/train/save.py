"""Saving a session as a checkpoint: a collective that every rank enters; rank 0 writes, all learn the outcome."""

from __future__ import annotations

from nanopt.errors import CheckpointError
from nanopt.runtime import all_gather_object, broadcast_object
from nanopt.train import checkpoint as ckpt
from nanopt.train.parallel import full_model_state, full_optimizer_state
from nanopt.train.resume import data_fingerprint
from nanopt.train.session import Session


def save_checkpoint(s: Session) -> None:
    """Gather the full state and every rank's loader/RNG state; rank 0 writes; every rank raises on failure."""
    model_state = full_model_state(s.prepared)
    optimizer_state = full_optimizer_state(s.prepared, s.optimizer)
    rank_states = all_gather_object(s.rt, s.train_state.rank_state_dict())
    outcome = None
    if s.rt.is_main:
        outcome = _write(s, model_state, optimizer_state, rank_states)
    outcome = broadcast_object(s.rt, outcome)
    if outcome is not None:
        raise CheckpointError(*outcome)
    s.state.last_checkpoint_step = s.state.step


def _write(s: Session, model_state: dict, optimizer_state: dict, rank_states: list) -> tuple[str, str] | None:
    st = s.state
    weights, tied = ckpt.dedupe_tied(model_state)
    # The checkpoint carries the tokenizer (and its EOS id), so eval, export and sampling work once the training
    # dataset is gone, and its hash lets them refuse a dataset made with another tokenizer.
    meta = {**s.train_state.state_dict(rank_states), "world_size": s.rt.world_size, "tied": tied,
            "config": s.run.snapshot(), "data_fingerprint": data_fingerprint(s.dataset),
            "tokenizer_sha256": s.dataset.tokenizer_sha256, "eos_id": s.dataset.eos_id}
    meta.pop("step")  # write_checkpoint sets it
    try:
        path = ckpt.write_checkpoint(s.run.run_dir, st.step, weights, optimizer_state, meta,
                                     tokenizer=s.dataset.tokenizer_path)
    except CheckpointError as exc:
        return exc.message, exc.hint
    if not (path / ckpt.TOKENIZER_FILE).is_file():
        s.observer.note(f"{path.name} does not carry the tokenizer: {s.dataset.tokenizer_path} changed since "
                        "training started; eval and export of it need --data with the original dataset")
    # `best` names only a checkpoint evaluated at its own step: a later one (the checkpoint interval is not a
    # multiple of the eval interval, a resume without evaluation, a preemption, an evaluation that failed) carries
    # the best loss so far but other weights.
    if st.val_step == st.step and st.last_val_loss == st.best_val_loss:
        ckpt.write_pointer(s.paths.checkpoints, "best", path.name)
    ckpt.apply_retention(s.run.run_dir, s.run.train.keep_checkpoints)
    s.metrics.write("event", step=st.step, event="checkpoint", path=str(path))
    return None
