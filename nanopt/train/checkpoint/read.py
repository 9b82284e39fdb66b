"""Reading a checkpoint: finding the one `latest`, `best` or a name means (the newest that verifies when the
pointer is missing or damaged, with a note for each one passed over), verifying it (meta.json, checksums, the
stored tensors against its config snapshot's model on the meta device) and loading its weights and optimizer
state, after checking that they fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nanopt.devices import check_memory
from nanopt.errors import CheckpointError
from nanopt.model.flops import count_params
from nanopt.model.memory import states_only
from nanopt.rundir import STEP_NAME, step_dir_name
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.contents import check_contents
from nanopt.train.checkpoint.meta import (
    FULL,
    SHARDED,
    Checkpoint,
    bad_meta,
    check_meta,
    checkpoints_dir,
    read_meta,
    read_pointer,
    sha256,
    unflatten_optimizer_state,
)
from nanopt.untrusted_text import shell_word


def step_of(path: Path) -> int | None:
    """The N of a directory named step-N (any number of digits), else None."""
    match = STEP_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every entry named step-N in checkpoints/, oldest first by N as a number: past step 999,999
    `step-1000000` sorts after `step-999999` although it sorts before it as a string."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir()]
    return sorted((step, p) for step, p in found if step is not None)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Step directories (not links) with a meta.json, oldest first by step (unverified; see `verify`)."""
    return [p for _, p in step_dirs(run_dir) if not p.is_symlink() and p.is_dir() and (p / "meta.json").is_file()]


def verify(path: Path) -> Checkpoint:
    """Open a checkpoint: meta.json well-formed and in range, every file present and matching its checksum, the
    shard index naming only files the checkpoint holds, and the stored tensors exactly those of its config
    snapshot's model (nanopt.train.checkpoint.contents). CheckpointError says what is wrong."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: meta.json is missing (an incomplete or foreign checkpoint)",
                              "use another checkpoint, or --resume none to start over")
    meta = read_meta(meta_path)
    check_meta(meta_path, meta)
    for name, expected in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: {name} is missing", "use another checkpoint")
        if sha256(file) != expected:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupted)", "use another checkpoint")
    if meta.get("layout") == SHARDED:
        sharded.check_complete(path, list(meta["files"]))
    # The safetensors headers or the shard index against the config snapshot (the tokenizer is parsed by whoever
    # uses it: nanopt.evaluate.trained): names, shapes and groups, before anything is allocated.
    check_contents(path, meta, bad_meta(meta_path))
    return Checkpoint(path=path, meta=meta)


def newest_valid(run_dir: Path, below: int | None = None) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint (by step number; before step `below` if given) that passes verification, and a note
    for each newer one that did not: a step directory without meta.json, a symbolic link, or a directory whose
    name is not its step."""
    skipped: list[str] = []
    for step, path in reversed(step_dirs(run_dir)):
        if below is not None and step >= below:
            continue
        try:
            return verify_discovered(path), skipped
        except CheckpointError as exc:
            skipped.append(exc.message)
    return None, skipped


def verify_discovered(path: Path) -> Checkpoint:
    """`verify`, for a step directory nanopt found by itself in checkpoints/: nanopt never writes a link there, and
    it names every directory after its step, so a link or a misnamed directory was put there by something else."""
    if path.is_symlink():
        raise CheckpointError(f"{path}: a symbolic link (nanopt never writes one)", "remove it")
    found = verify(path)
    if found.step != step_of(path):
        raise CheckpointError(f"{path}: its meta.json says step {found.step} (a renamed or copied directory)",
                              f"rename it to {step_dir_name(found.step)} or remove it")
    return found


def latest(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The checkpoint `latest` names, verified; when it is missing or damaged, the newest valid one, with notes.

    Following the pointer (not the highest step number) is what keeps a fresh start's checkpoints apart from any
    older ones: the pointer is replaced only after a checkpoint is complete."""
    root = checkpoints_dir(run_dir)
    name = read_pointer(root, "latest")
    if name is None:
        return newest_valid(run_dir)
    try:
        return verify_discovered(_named(root, name)), []
    except CheckpointError as exc:
        found, skipped = newest_valid(run_dir)
        said = (f"{root / name}:", f"{root / name}/")  # the same directory, said once is enough
        others = [note for note in skipped if not note.startswith(said)]
        return found, [f"'latest' names {name}, which cannot be used: {exc.message}", *others]


def resolve(run_dir: Path, which: str) -> Checkpoint:
    """`latest` (the latest pointer, verified), `best`, or a path to a step directory; verified."""
    root = checkpoints_dir(run_dir)
    if which in ("latest", "auto"):
        found, notes = latest(run_dir)
        if found is None and notes:  # there are checkpoints, and none of them can be used: say why
            raise CheckpointError(f"{run_dir}: no usable checkpoint: {notes[0]}",
                                  "name another checkpoint, or move the damaged one aside and train again")
        if found is None:
            raise CheckpointError(f"{run_dir}: no complete checkpoint",
                                  f"train first: `nanopt train {shell_word(run_dir)}`")
        return found
    if which == "best":
        name = read_pointer(root, "best")
        if name is None:
            raise CheckpointError(f"{run_dir}: no 'best' checkpoint yet (it needs an in-loop eval)",
                                  "use --checkpoint latest")
        return verify_discovered(_named(root, name))
    if Path(which).is_dir():  # a path the user typed (absolute or from the current directory) that exists
        return verify(Path(which))
    path = _named(root, which)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint '{which}' does not exist", f"choose latest, best or one of "
                              f"{[p.name for p in complete_checkpoints(run_dir)][-3:]}")
    return verify(path)


def _named(root: Path, name: str) -> Path:
    """A checkpoint name is looked up inside checkpoints/ only: '..' or '/' would read another directory."""
    if len(Path(name).parts) != 1 or name in (".", ".."):
        raise CheckpointError(f"checkpoint '{name}' does not exist (a name is looked up in {root} only, without "
                              "'/' or '..')", "give a name such as step-000600, latest or best, or the path of a "
                              "checkpoint directory that exists")
    return root / name


def load_model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The whole model's weights on the CPU, as the model's state_dict names them (tied aliases restored); a sharded
    checkpoint is consolidated here, tensor by tensor, into one copy of the weights. CheckpointError, before any
    is read, when they cannot fit this machine's memory."""
    check_fits(ckpt, torch.device("cpu"))
    state = (load_file(str(ckpt.path / "model.safetensors")) if ckpt.layout == FULL
             else sharded.read_model_state(ckpt.path))
    for alias, source in ckpt.meta.get("tied", {}).items():
        state[alias] = state[source]
    return state


def check_fits(ckpt: Checkpoint, device: torch.device) -> None:
    """CheckpointError, one line, when the model's fp32 weights alone (nanopt.model.memory's figure) exceed what
    `device` holds: a checkpoint is read in full, whatever machine it is opened on."""
    params = count_params(ckpt.model).total
    check_memory(states_only(params).weights, device, f"{ckpt.path}: its model's weights ({params:,} parameters)",
                 CheckpointError, "open it on a machine with more memory (or a GPU with more memory)")


def load_weights(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Copy the checkpoint's weights into `model`, Transformer(ckpt.model) (one process, any layout), tensor by
    tensor: memory stays at the model plus one tensor, not twice the model. Names and shapes were compared with
    the model's when the checkpoint was verified (nanopt.train.checkpoint.contents)."""
    aliases = ckpt.meta.get("tied", {})
    if ckpt.layout == SHARDED:
        sharded.load_model_weights(model, ckpt.path, aliases)
        return
    target = {key: value for key, value in model.state_dict().items() if key not in aliases}
    with safe_open(str(ckpt.path / "model.safetensors"), framework="pt") as stored, torch.no_grad():
        for key, tensor in target.items():
            tensor.copy_(stored.get_tensor(key))


def load_optimizer_state(ckpt: Checkpoint) -> dict[str, Any]:
    tensors = load_file(str(ckpt.path / "optimizer.safetensors"))
    return unflatten_optimizer_state(tensors, ckpt.meta["optimizer_param_groups"])
