"""Writing a checkpoint: assembled in `.tmp-step-N/` (`begin`), then `publish`ed (checksums, meta.json, fsync, a
rename into place, the `latest` pointer, in that order), so a process killed at any moment leaves the old set of
checkpoints or the new one; every file through nanopt.files (no link followed, nothing deleted outside
checkpoints/)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

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
from nanopt.rundir import RunDir, step_dir_name
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.meta import (
    FORMAT_VERSION,
    FULL,
    SHARDED,
    TOKENIZER_FILE,
    checkpoints_dir,
    flatten_optimizer_state,
    sha256,
)


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
            remove_step_dir(final)
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


def remove_step_dir(path: Path, spare: Callable[[], bool] | None = None) -> bool:
    """Delete a step directory by renaming it out of the step-* names first: a process killed while deleting
    leaves a `.tmp-*` that the next start removes, never a half-deleted checkpoint that looks damaged. Only inside
    its own checkpoints/, and never a step directory that is a link (refused).

    `spare`, asked once the directory is renamed: True gives it its name back, undeleted (a reader's hold that
    appeared meanwhile: nanopt.train.checkpoint.hold); returns whether it was deleted."""
    root, doomed = path.parent, path.with_name(f".tmp-delete-{path.name}")
    check_dir(root)  # not a link: even the rename below would change what it names
    if path.is_symlink():
        raise link_refused(path)
    remove_tree(doomed, inside=root, quiet=True)
    try:
        path.rename(doomed)
    except OSError:  # gone already, or not ours to move: delete it where it is
        doomed = path
    if spare is not None and doomed != path and spare():
        doomed.rename(path)
        return False
    remove_tree(doomed, inside=root, quiet=True)
    return True
