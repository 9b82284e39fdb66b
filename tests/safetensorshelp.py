"""Crafted safetensors files for the trust tests: a real file's header edited as a stranger could, its data kept."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path


def rewrite(path: Path, edit: Callable[[dict, bytearray], object]) -> None:
    """Rewrite the safetensors file at `path` in place after `edit(header, data)` changed its parsed header and the
    bytes after it (both in place); the header is written back as safetensors writes one (8-byte aligned)."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + length]), bytearray(raw[8 + length:])
    edit(header, data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def append_tensor(name: str, dtype: str, shape: list[int], size: int) -> Callable[[dict, bytearray], None]:
    """An edit that adds tensor `name` whose `size` bytes follow the others."""
    def edit(header: dict, data: bytearray) -> None:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + size]}
        data.extend(bytes(size))
    return edit
