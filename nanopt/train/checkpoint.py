"""Checkpoints: complete-or-not-at-all, verified by checksum, resumable on any world size.

    checkpoints/step-000600/
      model.safetensors       one process ("full" layout): the model's weights (tied weights once)
      optimizer.safetensors   its AdamW moments and steps (Muon momentum buffers), as "<param fqn>/<state name>"
      .metadata, __R_N.distcp several ranks ("sharded" layout): torch.distributed.checkpoint's index and each rank's
                              shards of the same tensors, under "model." and "optimizer.state." (nanopt.train.sharded)
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
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from nanopt.config import ModelConfig
from nanopt.errors import CheckpointError, NanoptError
from nanopt.files import (
    check_dir,
    copy_file,
    give_file_mode,
    link_refused,
    make_dir,
    new_dir,
    remove_tree,
    replace_file,
    write_file,
)
from nanopt.model.flops import count_params
from nanopt.model.memory import states_only
from nanopt.parsing import read_capped, read_json
from nanopt.rundir import STEP_NAME, RunDir, step_dir_name
from nanopt.runtime import check_memory
from nanopt.shown import shell_word
from nanopt.train import sharded
from nanopt.train.contents import check_contents, snapshot_model
from nanopt.train.meta_fields import Bad, check_resume_fields

FORMAT_VERSION = 1
FULL, SHARDED = "full", "sharded"  # meta.json's `layout` (absent before sharded checkpoints existed: full)
POINTER_MAX_BYTES = 4096  # `latest` and `best` name a step directory: a few dozen bytes
_FILES = ("model.safetensors", "optimizer.safetensors")  # in every full checkpoint
TOKENIZER_FILE = "tokenizer.json"  # in those written since checkpoints carry their tokenizer


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    meta: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def layout(self) -> str:
        return self.meta.get("layout", FULL)

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer.json this checkpoint carries (verified with the other files), or None for a checkpoint
        written before checkpoints carried one."""
        return self.path / TOKENIZER_FILE if TOKENIZER_FILE in self.meta["files"] else None

    @property
    def model(self) -> ModelConfig:
        """The model its config snapshot describes, validated as model.json is."""
        return snapshot_model(self.meta, _bad(self.path / "meta.json"))


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ writing


def write_checkpoint(run_dir: Path, step: int, model_state: dict[str, torch.Tensor],
                     optimizer_state: dict[str, Any], meta: dict[str, Any], tokenizer: Path | None = None) -> Path:
    """Write one full-layout checkpoint atomically (one process). Raises CheckpointError if the disk refuses.

    `tokenizer` (the dataset's tokenizer.json) is copied in when it is still the file meta's `tokenizer_sha256`
    names, so the checkpoint is usable without the dataset."""
    tmp = begin(run_dir, step)
    groups = write_full(run_dir, step, tmp, model_state, optimizer_state)
    return publish(run_dir, step, {**meta, "layout": FULL, "optimizer_param_groups": groups}, tokenizer)


def write_full(run_dir: Path, step: int, tmp: Path, model_state: dict[str, torch.Tensor],
               optimizer_state: dict[str, Any]) -> list[dict[str, Any]]:
    """The full layout's two safetensors files into `tmp`; returns the optimizer's param groups for meta.json."""
    try:
        save_tensors(_contiguous(model_state), tmp / "model.safetensors")
        tensors, groups = flatten_optimizer_state(optimizer_state)
        save_tensors(tensors, tmp / "optimizer.safetensors")
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
        raise _write_failed(tmp, RunDir(run_dir).step_dir(step), exc) from None
    return groups


def begin(run_dir: Path, step: int) -> Path:
    """The empty `.tmp-step-N/` a checkpoint is assembled in (made by rank 0; every rank writes into it)."""
    root = checkpoints_dir(run_dir)
    tmp = root / f".tmp-{step_dir_name(step)}"
    try:
        make_dir(root, parents=True)  # a link or a file there is refused, never followed
        remove_tree(tmp, inside=root)
        new_dir(tmp)  # ours: every rank, and DCP, writes into it
    except OSError as exc:
        raise _write_failed(tmp, RunDir(run_dir).step_dir(step), exc) from None
    return tmp


def publish(run_dir: Path, step: int, meta: dict[str, Any], tokenizer: Path | None = None) -> Path:
    """Turn the assembled `.tmp-step-N/` into step-N: checksum every file in it, add the tokenizer, write meta.json
    last, fsync, rename into place, then point `latest` at it (rank 0). On failure the temporary directory is removed
    and the earlier checkpoints and pointers are as they were."""
    final = RunDir(run_dir).step_dir(step)
    root = final.parent
    tmp = root / f".tmp-{final.name}"
    try:
        files = {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        if meta.get("layout") == SHARDED:
            sharded.check_complete(tmp, list(files))
            give_file_mode(*(tmp / name for name in files))  # DCP's files keep group write under umask 002
        if tokenizer is not None and _copy_tokenizer(tokenizer, tmp / TOKENIZER_FILE, meta.get("tokenizer_sha256")):
            files[TOKENIZER_FILE] = meta["tokenizer_sha256"]
        full_meta = {**meta, "format_version": FORMAT_VERSION, "step": step, "files": files}
        write_file(tmp / "meta.json", json.dumps(full_meta, indent=1))
        _fsync_dir_files(tmp)
        if final.is_symlink() or final.exists():  # a re-run of the step (a crash between rename and pointer)
            _remove(final)
        tmp.rename(final)
        _fsync(root)
        write_pointer(root, "latest", final.name)
    except (OSError, SafetensorError) as exc:
        raise _write_failed(tmp, final, exc) from None
    except NanoptError:  # incomplete shards, or a link where the checkpoint goes
        remove_tree(tmp, inside=root, quiet=True)
        raise
    return final


def abandon(run_dir: Path, step: int) -> None:
    """Remove the `.tmp-step-N/` of a save that failed on some rank."""
    root = checkpoints_dir(run_dir)
    remove_tree(root / f".tmp-{step_dir_name(step)}", inside=root, quiet=True)


def _write_failed(tmp: Path, final: Path, exc: BaseException) -> CheckpointError:
    remove_tree(tmp, inside=tmp.parent, quiet=True)
    hint = "free disk space or fix permissions; earlier checkpoints and 'latest' are intact"
    reason = getattr(exc, "strerror", None) or exc
    return CheckpointError(f"could not write checkpoint {final}: {reason}", hint)


def _copy_tokenizer(source: Path, target: Path, expected_sha256: str | None) -> bool:
    """Copy the tokenizer training used. False, and no copy, when `source` is no longer that file (its dataset was
    re-made at the same path during training): a checkpoint must never carry another tokenizer than its own."""
    copy_file(source, target)
    if sha256(target) == expected_sha256:
        return True
    target.unlink()
    return False


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file into a directory nanopt made, leaving the file with the mode nanopt's own files get:
    safetensors writes through a private temporary file (0600) renamed into place, and weights that only their
    owner can read are useless to the rest of a team sharing the machine."""
    save_file(tensors, str(path), metadata=metadata)
    give_file_mode(path)


def _contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir_files(directory: Path) -> None:
    for child in directory.iterdir():
        _fsync(child)
    _fsync(directory)


def write_pointer(root: Path, name: str, target: str) -> None:
    replace_file(root / name, target + "\n")


def read_pointer(root: Path, name: str) -> str | None:
    """The step directory a pointer names, or None when there is no pointer (or it cannot be read)."""
    path = root / name
    if not path.is_file():
        return None
    try:  # a step name: a stranger's pointer may be a huge file, or swapped for a pipe; neither is read whole
        return read_capped(path, POINTER_MAX_BYTES, CheckpointError, "").decode("utf-8").strip() or None
    except (NanoptError, UnicodeDecodeError):
        return None


def flatten_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """{"state": {fqn: {name: tensor}}, "param_groups": [...]} -> flat tensors + JSON-able groups."""
    tensors: dict[str, torch.Tensor] = {}
    for fqn, entries in state["state"].items():
        for name, value in entries.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{fqn}/{name}"] = value.detach().contiguous().cpu()
    return tensors, state["param_groups"]


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        fqn, _, name = key.rpartition("/")
        state.setdefault(fqn, {})[name] = value
    return {"state": state, "param_groups": groups}


# -------------------------------------------------------------------------------------------- retention


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


def apply_retention(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints; never the newest, never the one `best` names. Only directories
    nanopt wrote count, named after the step their meta.json records: a foreign or renamed one is never deleted and
    takes no slot (else it would keep one of the `keep` real checkpoints from being kept)."""
    root = checkpoints_dir(run_dir)
    protected = {read_pointer(root, "best"), read_pointer(root, "latest")}
    complete = [p for p in complete_checkpoints(run_dir) if _named_after_its_step(p)]
    doomed = [p for p in complete[:-max(1, keep)] if p.name not in protected]
    for path in doomed:
        _remove(path)
    return doomed


def _named_after_its_step(path: Path) -> bool:
    """Whether `path` is named step_dir_name(the step its meta.json records); unreadable or foreign: False."""
    try:
        step = _read_meta(path / "meta.json").get("step")
    except (NanoptError, AttributeError):  # AttributeError: JSON that is not an object
        return False
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and path.name == step_dir_name(step)


def _remove(path: Path) -> None:
    """Delete a step directory by renaming it out of the step-* names first: a process killed while deleting
    leaves a `.tmp-*` that the next start removes, never a half-deleted checkpoint that looks damaged. Only inside
    its own checkpoints/, and never a step directory that is a link (refused)."""
    root, doomed = path.parent, path.with_name(f".tmp-delete-{path.name}")
    check_dir(root)  # not a link: even the rename below would change what it names
    if path.is_symlink():
        raise link_refused(path)
    remove_tree(doomed, inside=root, quiet=True)
    try:
        path.rename(doomed)
    except OSError:  # gone already, or not ours to move: delete in place as before
        doomed = path
    remove_tree(doomed, inside=root, quiet=True)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Half-written `.tmp-*` directories left by a killed process are never read; delete them (only real
    directories inside the run's own checkpoints/: nanopt.files.remove_tree)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir() and not root.is_symlink():
        for path in root.glob(".tmp-*"):
            remove_tree(path, inside=root, quiet=True)


# ------------------------------------------------------------------------------------------------ reading


def _read_meta(path: Path) -> Any:
    """A checkpoint's meta.json, read as any file from a stranger is (nanopt.parsing.read_json: bounded, never
    blocking, no traceback for a runaway nesting or a 5,000-digit number); CheckpointError otherwise."""
    return read_json(path, error=CheckpointError, hint="use another checkpoint",
                     contents_hint="use another checkpoint (this meta.json is not one nanopt wrote)")


def verify(path: Path) -> Checkpoint:
    """Open a checkpoint: meta.json well-formed and in range, every file present and matching its checksum, the
    shard index naming only files the checkpoint holds, and the stored tensors exactly those of its config
    snapshot's model (nanopt.train.contents). CheckpointError says what is wrong."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: meta.json is missing (an incomplete or foreign checkpoint)",
                              "use another checkpoint, or --resume none to start over")
    meta = _read_meta(meta_path)
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
    check_contents(path, meta, _bad(meta_path))
    return Checkpoint(path=path, meta=meta)


# The fields nanopt writes into meta.json and reads back, with their JSON types. A checkpoint whose meta.json
# lacks one or has another type is damaged or foreign: it is skipped like a truncated one, never half-loaded.
_REQUIRED = {"format_version": int, "step": int, "tokens": int, "files": dict, "optimizer_param_groups": list,
             "world_size": int, "ranks": list, "config": dict}
_OPTIONAL = {"best_val_loss": (int, float, type(None)), "skipped_steps": int, "metrics": dict, "tied": dict,
             "data_fingerprint": (str, type(None)), "tokenizer_sha256": (str, type(None)), "eos_id": int,
             "layout": str}


def _bad(meta_path: Path) -> Bad:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{meta_path}: {what} (a damaged or foreign checkpoint)", "use another checkpoint")
    return bad


def check_meta(meta_path: Path, meta: Any) -> None:
    """CheckpointError unless meta.json has every field nanopt reads, each of the right type and in range
    (nanopt.train.meta_fields)."""
    bad = _bad(meta_path)
    if not isinstance(meta, dict):
        raise bad(f"holds a JSON {type(meta).__name__}, not an object")
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key not in meta:
            if key in _REQUIRED:
                raise bad(f"has no '{key}'")
        elif not isinstance(meta[key], kind) or (kind is int and isinstance(meta[key], bool)):
            raise bad(f"'{key}' is {type(meta[key]).__name__} {str(meta[key])[:40]!r}")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: written in checkpoint format {meta['format_version']}, newer than this "
                              f"nanopt's {FORMAT_VERSION}", "upgrade nanopt, or use another checkpoint")
    _check_files(meta, bad)
    if TOKENIZER_FILE in meta["files"] and (meta.get("tokenizer_sha256") != meta["files"][TOKENIZER_FILE]
                                            or "eos_id" not in meta):
        raise bad(f"a carried {TOKENIZER_FILE} needs its 'eos_id' and the same sha256 as 'tokenizer_sha256'")
    if not meta["ranks"] or not all(isinstance(r, dict) and isinstance(r.get("loader"), dict)
                                    and isinstance(r.get("rng"), dict) for r in meta["ranks"]):
        raise bad("'ranks' must list each rank's loader and RNG state")
    if not all(isinstance(meta["config"].get(part), dict) for part in ("model", "train")):
        raise bad("'config' must hold the model and train settings")
    check_resume_fields(meta, bad)


def _check_files(meta: dict[str, Any], bad: Any) -> None:
    """meta.json's `files`: what its layout writes (and perhaps the tokenizer), each with a sha256 string."""
    files, layout = meta["files"], meta.get("layout", FULL)
    names = set(files) - {TOKENIZER_FILE}
    if layout == FULL:
        ok, expected = names == set(_FILES), " and ".join(_FILES)
    elif layout == SHARDED:
        ok = sharded.METADATA_FILE in names and all(sharded.is_shard_file(n) for n in names)
        expected = f"{sharded.METADATA_FILE} and shard files __R_N.distcp"
    else:
        raise bad(f"'layout' is {layout[:20]!r}, not {FULL!r} or {SHARDED!r}")
    if not ok or not all(isinstance(v, str) for v in files.values()):
        raise bad(f"'files' must name {expected} (and may name {TOKENIZER_FILE}) with their sha256")


def newest_valid(run_dir: Path) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint (by step number) that passes verification, and a note for each newer one that did
    not: a step directory without meta.json, a symbolic link, or a directory whose name is not its step."""
    skipped: list[str] = []
    for _, path in reversed(step_dirs(run_dir)):
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
    the model's when the checkpoint was verified (nanopt.train.contents)."""
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
