"""Where an import reads from: a local transformers directory, or a hub repository fetched with huggingface_hub's
snapshot_download (config, tokenizer and safetensors files only: a pickle is never downloaded, let alone read).

A source is a stranger's files: config.json and the index are read bounded (nanopt.parsing.read_json), the
weights only through safetensors headers here, every shard named by the index must be a plain file name in the
directory, and pickle weights (pytorch_model.bin) are refused, never loaded: unpickling runs code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.errors import CheckpointError, ConfigError, DataError
from nanopt.parsing import read_json, show_value
from nanopt.untrusted_text import printable

# What snapshot_download fetches: enough to import, and nothing that could be a pickle.
ALLOW_PATTERNS = ["config.json", "tokenizer.json", "tokenizer_config.json", "*.safetensors",
                  "model.safetensors.index.json"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
# A shard's name as transformers writes it (model-00001-of-00004.safetensors): no separator, not hidden, ASCII.
_SHARD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,200}\.safetensors")
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "flax_model.msgpack",
            "tf_model.h5")


@dataclass(frozen=True)
class Source:
    """A transformers checkpoint on this machine: its directory, config.json parsed, the safetensors files in
    order, and what the user typed (for the report and meta.json)."""

    directory: Path
    name: str
    revision: str | None
    config: Any
    weight_files: list[Path]

    @property
    def tokenizer_json(self) -> Path:
        return self.directory / "tokenizer.json"

    @property
    def tokenizer_config(self) -> Any:
        path = self.directory / "tokenizer_config.json"
        return read_json(path, error=DataError, hint="fix or remove tokenizer_config.json") if path.is_file() else {}


def open_source(source: str, revision: str | None = None) -> Source:
    """The local directory `source` names, or else the hub repository (downloaded to the hub cache)."""
    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{source}: is not a directory", "pass a transformers model directory or a hub name")
        if revision is not None:
            raise ConfigError(f"--revision {revision}: {source} is a local directory, which has no revisions",
                              "leave out --revision, or pass a hub name")
        directory = path
    elif _HUB_NAME.fullmatch(source):
        directory = _download(source, revision)
    else:
        raise ConfigError(f"{source}: no such directory, and not a hub name (owner/name)",
                          "pass a local transformers directory or e.g. HuggingFaceTB/SmolLM2-135M")
    config_path = directory / "config.json"
    hint = "pass a directory saved by transformers' save_pretrained (config.json and model.safetensors)"
    config = read_json(config_path, error=ConfigError, hint=hint)
    return Source(directory, source, revision, config, _weight_files(directory))


def _download(name: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"{name}: downloading from the hub needs huggingface_hub", "pip install huggingface_hub, "
                          "or download the model yourself and pass its directory") from None
    try:
        return Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:  # network, authentication (gated models), unknown repository or revision
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{name}: could not download it from the hub ({type(exc).__name__}: {reason})",
                          "check the name, --revision and your network; gated models need `hf auth login`; or "
                          "pass a local directory") from None


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files, from the index when the checkpoint is sharded; a pickle-only checkpoint refused."""
    if (directory / INDEX).is_file():
        return [directory / name for name in _index_files(directory / INDEX)]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    pickles = [name for name in _PICKLES if (directory / name).exists()]
    pickles += sorted(p.name for p in directory.glob("pytorch_model-*.bin"))[:1]
    if pickles:
        raise CheckpointError(f"{directory}: its weights are {pickles[0]}, not safetensors: loading a pickle runs "
                              "whatever code it holds, and nanopt never does", "use a revision that has "
                              "model.safetensors (most hub models do), or convert it yourself where you trust it")
    raise CheckpointError(f"{directory}: no {SINGLE} or {INDEX}", "pass a directory saved by transformers' "
                          "save_pretrained")


def _index_files(path: Path) -> list[str]:
    """The shard names the index's weight_map holds as values (its keys, tensor names, go unused: each shard's
    header says what it holds). Read through read_json, so the index costs at most JSON_MAX_BYTES (64 MiB) of
    text and what it parses to; every value must be a plain shard name (_SHARD), so nothing outside the directory,
    no path to elsewhere, and no name the file system cannot take (a NUL, a lone surrogate) is ever opened."""
    index = read_json(path, error=CheckpointError, hint="re-download the model")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        shown = "no 'weight_map'" if weight_map is None else f"a 'weight_map' of {show_value(weight_map)}"
        raise CheckpointError(f"{path}: has {printable(shown)}, not an object of tensor names to shard files",
                              "re-download the model")
    for name in weight_map.values():
        if not isinstance(name, str) or not _SHARD.fullmatch(name):
            raise CheckpointError(f"{path}: weight_map names {printable(show_value(name, 80))}, not a "
                                  ".safetensors file in the same directory", "re-download the model")
    return sorted(set(weight_map.values()))
