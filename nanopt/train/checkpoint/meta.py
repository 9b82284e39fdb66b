"""A checkpoint's directory contract: the names of its files, the `latest` / `best` pointers, the layout of
optimizer.safetensors, and meta.json, read as any file from a stranger is and checked field by field before
anything is restored from it (nanopt.train.checkpoint.meta_fields, nanopt.train.checkpoint.contents)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanopt.config import ModelConfig
from nanopt.errors import CheckpointError, NanoptError
from nanopt.parsing import read_capped, read_json
from nanopt.rundir import RunDir
from nanopt.train.checkpoint import sharded
from nanopt.train.checkpoint.contents import snapshot_model
from nanopt.train.checkpoint.meta_fields import Bad, check_resume_fields, check_weights_only_fields

FORMAT_VERSION = 1
FULL, SHARDED = "full", "sharded"  # meta.json's `layout` (absent before sharded checkpoints existed: full)
POINTER_MAX_BYTES = 4096  # `latest` and `best` name a step directory: a few dozen bytes
FULL_FILES = ("model.safetensors", "optimizer.safetensors")  # in every full checkpoint
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
        return snapshot_model(self.meta, bad_meta(self.path / "meta.json"))


def is_imported(meta: Any) -> bool:
    """Whether a checkpoint's meta.json is `nanopt import`'s model (a run's step 0): retention never deletes it, and
    a fresh start of its run (`--resume none`) begins from it."""
    return isinstance(meta, dict) and bool(meta.get("imported_from"))


def checkpoints_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).checkpoints


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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


def read_meta(path: Path) -> Any:
    """A checkpoint's meta.json, read as any file from a stranger is (nanopt.parsing.read_json: bounded, never
    blocking, no traceback for a runaway nesting or a 5,000-digit number); CheckpointError otherwise."""
    return read_json(path, error=CheckpointError, hint="use another checkpoint",
                     contents_hint="use another checkpoint (this meta.json is not one nanopt wrote)")


# The fields nanopt writes into meta.json and reads back, with their JSON types. A checkpoint whose meta.json
# lacks one or has another type is damaged or foreign: it is skipped like a truncated one, never half-loaded.
_REQUIRED = {"format_version": int, "step": int, "tokens": int, "files": dict, "optimizer_param_groups": list,
             "world_size": int, "ranks": list, "config": dict}
_OPTIONAL = {"best_val_loss": (int, float, type(None)), "skipped_steps": int, "metrics": dict, "tied": dict,
             "data_fingerprint": (str, type(None)), "tokenizer_sha256": (str, type(None)), "eos_id": int,
             "layout": str, "weights_only": bool, "imported_from": dict, "device_type": str, "loss_scale": dict}
# A weights-only checkpoint (`nanopt import`'s step 0) holds a model and nothing of a training session: no optimizer
# state, no loader or RNG state. Training starts from its weights with a fresh optimizer at step 0.
WEIGHTS_ONLY_ABSENT = ("optimizer_param_groups", "world_size", "ranks")


def bad_meta(meta_path: Path) -> Bad:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{meta_path}: {what} (a damaged or foreign checkpoint)", "use another checkpoint")
    return bad


def check_meta(meta_path: Path, meta: Any) -> None:
    """CheckpointError unless meta.json has every field nanopt reads, each of the right type and in range
    (nanopt.train.checkpoint.meta_fields)."""
    bad = bad_meta(meta_path)
    if not isinstance(meta, dict):
        raise bad(f"holds a JSON {type(meta).__name__}, not an object")
    weights_only = meta.get("weights_only") is True
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key not in meta:
            if key in _REQUIRED and not (weights_only and key in WEIGHTS_ONLY_ABSENT):
                raise bad(f"has no '{key}'")
        elif weights_only and key in WEIGHTS_ONLY_ABSENT:
            raise bad(f"is weights-only and has '{key}', which belongs to a training session")
        elif not isinstance(meta[key], kind) or (kind is int and isinstance(meta[key], bool)):
            raise bad(f"'{key}' is {type(meta[key]).__name__} {str(meta[key])[:40]!r}")
    if meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: written in checkpoint format {meta['format_version']}, newer than this "
                              f"nanopt's {FORMAT_VERSION}", "upgrade nanopt, or use another checkpoint")
    _check_files(meta, bad)
    if TOKENIZER_FILE in meta["files"] and (meta.get("tokenizer_sha256") != meta["files"][TOKENIZER_FILE]
                                            or "eos_id" not in meta):
        raise bad(f"a carried {TOKENIZER_FILE} needs its 'eos_id' and the same sha256 as 'tokenizer_sha256'")
    if not all(isinstance(meta["config"].get(part), dict) for part in ("model", "train")):
        raise bad("'config' must hold the model and train settings")
    if weights_only:
        check_weights_only_fields(meta, bad)
        return
    if not meta["ranks"] or not all(isinstance(r, dict) and isinstance(r.get("loader"), dict)
                                    and isinstance(r.get("rng"), dict) for r in meta["ranks"]):
        raise bad("'ranks' must list each rank's loader and RNG state")
    check_resume_fields(meta, bad)


def _check_files(meta: dict[str, Any], bad: Any) -> None:
    """meta.json's `files`: what its layout writes (and perhaps the tokenizer), each with a sha256 string."""
    files, layout = meta["files"], meta.get("layout", FULL)
    names = set(files) - {TOKENIZER_FILE}
    if meta.get("weights_only") is True:
        ok, expected = layout == FULL and names == {FULL_FILES[0]}, f"{FULL_FILES[0]} (layout {FULL!r}) only"
    elif layout == FULL:
        ok, expected = names == set(FULL_FILES), " and ".join(FULL_FILES)
    elif layout == SHARDED:
        ok = sharded.METADATA_FILE in names and all(sharded.is_shard_file(n) for n in names)
        expected = f"{sharded.METADATA_FILE} and shard files __R_N.distcp"
    else:
        raise bad(f"'layout' is {layout[:20]!r}, not {FULL!r} or {SHARDED!r}")
    if not ok or not all(isinstance(v, str) for v in files.values()):
        raise bad(f"'files' must name {expected} (and may name {TOKENIZER_FILE}) with their sha256")
