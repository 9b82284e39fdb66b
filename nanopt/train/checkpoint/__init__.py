"""Checkpoints: complete-or-not-at-all, verified by checksum, resumable on any world size.

    checkpoints/step-000600/
      model.safetensors       one process ("full" layout): the model's weights (tied weights once)
      optimizer.safetensors   its AdamW moments and steps (Muon momentum buffers), as "<param fqn>/<state name>"
      .metadata, __R_N.distcp several ranks ("sharded" layout): torch.distributed.checkpoint's index and each rank's
                              shards of the same tensors, under "model." and "optimizer.state." (`sharded`)
      tokenizer.json          the exact tokenizer the run trained with, so eval, export and sampling need no
                              dataset (checkpoints from before it was carried lack it: their dataset has it)
      meta.json               layout, step, tokens, every rank's loader and RNG state, config snapshot, metrics,
                              optimizer param groups, the EOS id, sha256 of every file; written last
    checkpoints/latest        a one-line file naming the newest complete checkpoint, replaced atomically
    checkpoints/best          the same for the lowest validation loss

A checkpoint is assembled in `.tmp-step-N/` (`begin`), then `publish`ed: checksums, meta.json, fsync, a rename into
place and the `latest` pointer, in that order, so a process killed at any moment (also while a save runs in the
background) leaves either the old set of checkpoints or the new one. Either layout resumes on any world size and
is read by eval and export. No pickle of ours: tensors in safetensors or DCP shards, everything else JSON. Files
get 0644 and directories 0755, less the umask, so others on a shared machine can read a run and none can change it;
nothing is written or deleted through a link, and deletion stays inside the run's own checkpoints/ (nanopt.files).

The parts: `meta` (the contract: file names, pointers, meta.json read and checked), `write` (begin, publish,
pointers), `read` (find, verify, load) and `retention`. The names below are the package's interface. Beside them,
what the layouts and a session need: `meta_fields` (meta.json's resume fields, range-checked), `contents` (the
stored tensors against the config snapshot), `sharded` and `shard_index` (DCP's shards and its index read safely),
`hold` (checkpoints another process is reading), `save` (a session's save, in the background, as a collective)
and `resume` (a session put back from either layout on any world size).
"""

from nanopt.rundir import step_dir_name
from nanopt.train.checkpoint.meta import (
    FORMAT_VERSION,
    FULL,
    SHARDED,
    TOKENIZER_FILE,
    Checkpoint,
    check_meta,
    checkpoints_dir,
    flatten_optimizer_state,
    is_imported,
    read_meta,
    read_pointer,
    sha256,
    unflatten_optimizer_state,
)
from nanopt.train.checkpoint.read import (
    check_fits,
    complete_checkpoints,
    latest,
    load_model_state,
    load_optimizer_state,
    load_weights,
    newest_valid,
    resolve,
    step_dirs,
    step_of,
    verify,
    verify_discovered,
)
from nanopt.train.checkpoint.retention import apply_retention, remove_stale_temporaries
from nanopt.train.checkpoint.write import (
    abandon,
    begin,
    publish,
    save_tensors,
    write_checkpoint,
    write_full,
    write_pointer,
)

__all__ = [
    "FORMAT_VERSION", "FULL", "SHARDED", "TOKENIZER_FILE", "Checkpoint", "abandon", "apply_retention", "begin",
    "check_fits", "check_meta", "checkpoints_dir", "complete_checkpoints", "flatten_optimizer_state", "is_imported",
    "latest", "load_model_state", "load_optimizer_state", "load_weights", "newest_valid", "publish", "read_meta",
    "read_pointer", "remove_stale_temporaries", "resolve", "save_tensors", "sha256", "step_dir_name", "step_dirs",
    "step_of", "unflatten_optimizer_state", "verify", "verify_discovered", "write_checkpoint", "write_full",
    "write_pointer",
]
