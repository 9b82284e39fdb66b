"""The source's safetensors tensors -> the checkpoint's model.safetensors, one tensor at a time.

Each source file's header is read and checked first (nanopt.safetensors_header: bounded, every tensor inside the
file, exactly as large as its shape and dtype say, and in a dtype nanopt reads), the names and shapes are compared
with what nanopt.model.hf_names says the model holds, and only then is anything written. The output file is written
by nanopt, not by safetensors' save_file, so the whole model is never in memory: its header is known from the
shapes, then each source tensor is read with a plain read (no memory map: the pages of a read-once file would count
as the process's memory), converted to fp32 (the master weights nanopt trains), transposed or split where GPT-2's
layout asks, and written. Peak memory is a few copies of the largest tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanopt.config import ModelConfig
from nanopt.errors import CheckpointError
from nanopt.files import open_file
from nanopt.model.hf_names import HFTensor, hf_tensors
from nanopt.model.layout import few, tensor_specs
from nanopt.parsing import open_regular
from nanopt.safetensors_header import DTYPES, read_header

# The dtypes a weight may come in (the header's reader admits integer buffers too; plan refuses them as weights).
_DTYPES = {name: getattr(torch, DTYPES[name][0]) for name in ("F32", "F16", "BF16", "F64")}
# Buffers some checkpoints store that are not weights: GPT-2's causal mask, old Llama's RoPE frequencies.
_BUFFERS = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)|model\.layers\.\d+\.self_attn\.rotary_emb\."
                      r"inv_freq")
HINT = "re-download the model, or pass a checkpoint saved by transformers' save_pretrained"


@dataclass(frozen=True)
class Stored:
    """One tensor in a source file: where its bytes are and what they hold."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


@dataclass(frozen=True)
class Planned:
    entry: HFTensor
    stored: Stored
    pieces: tuple[tuple[str, tuple[int, ...]], ...]  # nanopt's names and shapes, in the order they are cut


def read_headers(files: list[Path]) -> dict[str, Stored]:
    """Every tensor of every file, by name; CheckpointError for a malformed header or a name in two files."""
    found: dict[str, Stored] = {}
    for file in files:
        for name, stored in _header(file).items():
            if name in found:
                raise CheckpointError(f"{file}: holds {name[:80]!r}, which {found[name].file.name} holds too", HINT)
            found[name] = stored
    return found


def _header(file: Path) -> dict[str, Stored]:
    return {name: Stored(file, tensor.dtype, tensor.shape, tensor.start, tensor.end)
            for name, tensor in read_header(file, CheckpointError, HINT).items()}


def plan(cfg: ModelConfig, stored: dict[str, Stored]) -> list[Planned]:
    """Which stored tensor becomes which of nanopt's, in file order; CheckpointError for any name or shape that
    differs from what the model holds (nothing is written before this passes)."""
    if cfg.architecture == "gpt2" and not any(name.startswith("transformer.") for name in stored):
        stored = {f"transformer.{name}": value for name, value in stored.items()}  # saved from GPT2Model (the hub's)
    specs = tensor_specs(cfg)
    entries = hf_tensors(cfg)
    expected = {entry.name for entry in entries}
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # transformers ties it on load
    unexpected = sorted(n for n in stored if n not in expected and n not in ignored and not _BUFFERS.fullmatch(n))
    missing = sorted(expected - set(stored))
    if missing or unexpected:
        raise CheckpointError(f"the weights are not those of config.json's model: missing {few(missing)}, "
                              f"unexpected {few(unexpected)}", HINT)
    planned = []
    for entry in entries:
        source = stored[entry.name]
        pieces = tuple((name, specs[name].shape) for name in entry.ours)
        want = (sum(shape[0] for _, shape in pieces), *pieces[0][1][1:])
        want = want[::-1] if entry.transposed else want
        if source.dtype not in _DTYPES:
            raise CheckpointError(f"{source.file}: {entry.name} is {source.dtype}, not a float tensor", HINT)
        if source.shape != tuple(want):
            raise CheckpointError(f"{source.file}: {entry.name} has shape {source.shape}, config.json's model "
                                  f"{tuple(want)}", HINT)
        planned.append(Planned(entry, source, pieces))
    return sorted(planned, key=lambda p: (str(p.stored.file), p.stored.start))  # each file read front to back


def write(path: Path, planned: list[Planned]) -> int:
    """Write model.safetensors (fp32) from the plan, one tensor at a time; returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in planned:
        for name, shape in item.pieces:
            size = math.prod(shape) * 4
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open_file(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for item in planned:
            tensor = _read(item.stored).to(torch.float32)
            tensor = tensor.T if item.entry.transposed else tensor
            for piece in tensor.split([shape[0] for _, shape in item.pieces], dim=0):
                out.write(piece.contiguous().view(torch.uint8).numpy().data)
            del tensor
    return 8 + len(text) + offset


def _read(stored: Stored) -> torch.Tensor:
    dtype = _DTYPES[stored.dtype]
    if stored.end == stored.start:
        return torch.empty(stored.shape, dtype=dtype)
    buffer = bytearray(stored.end - stored.start)
    with open_regular(stored.file, CheckpointError, HINT, "safetensors file") as f:
        f.seek(stored.start)
        if f.readinto(buffer) != len(buffer):
            raise CheckpointError(f"{stored.file}: ends before its tensors do (truncated)", HINT)
    return torch.frombuffer(buffer, dtype=dtype).reshape(stored.shape)


def parameters(planned: list[Planned]) -> int:
    return sum(math.prod(shape) for item in planned for _, shape in item.pieces)
