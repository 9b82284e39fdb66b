"""The one reader of a safetensors file's header: a checkpoint's model.safetensors and optimizer.safetensors
(nanopt.train.checkpoint.contents) and an imported model's files (nanopt.importer.weights) may come from a stranger.

Reading never runs code (the header is JSON) and is bounded: the file is opened as every untrusted file is
(nanopt.parsing.open_regular: never a pipe or a device), and the header's length is checked against the file's size
and a cap before a byte of it is read. Every tensor is then checked as safetensors' own loader checks it, and a
little more: its dtype one nanopt maps to a torch dtype, each dimension in range, its bytes inside the file and
exactly as many as its shape and dtype say, and the tensors' bytes back to back from the header's end to the
file's end (no gap, no overlap, nothing after them), so what nanopt checks here is what safetensors or a plain
read will load. `__metadata__`, if present, is a map of strings. Every problem is the caller's error class, one
line naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.errors import NanoptError
from nanopt.parsing import open_regular, parse_json_text

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
MAX_DIMENSION = 2**40  # far past any real tensor, small enough that a product of a few stays exact in a float
METADATA = "__metadata__"
# The dtypes nanopt reads: safetensors' name -> torch's name and the bytes of one element. Others (float8, the
# unsigned integers past 8 bits) have no place in a nanopt checkpoint or a model nanopt imports.
DTYPES = {"F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
          "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
          "BOOL": ("bool", 1)}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file, checked: what it holds and where its bytes are."""

    dtype: str  # safetensors' name, one of DTYPES
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int

    @property
    def torch_dtype(self) -> str:
        """torch's name of the dtype ("float32"), as torch.float32 is getattr(torch, name)."""
        return DTYPES[self.dtype][0]


def read_header(file: Path, error: type[NanoptError], hint: str) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file `file` by name, in the file's order, checked (see the module docstring);
    anything wrong is `error` with `hint`."""
    header, base, size = _read_json(file, error, hint)

    def bad(what: str) -> NanoptError:
        return error(f"{file}: {what}", hint)

    if not isinstance(header, dict):
        raise bad("its safetensors header is not an object")
    metadata = header.get(METADATA, {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad(f"its safetensors header's {METADATA} is {str(metadata)[:40]}, not a map of strings")
    tensors = {name: _tensor(info, base, size, lambda what, n=name: bad(f"tensor {n[:80]!r} {what}"))
               for name, info in header.items() if name != METADATA}
    _check_back_to_back(tensors, base, size, bad)
    return tensors


def _read_json(file: Path, error: type[NanoptError], hint: str) -> tuple[Any, int, int]:
    """The header parsed, where the tensors' bytes start, and the file's size; the length is checked before the
    header is read, so a crafted length never allocates more than the file holds."""
    with open_regular(file, error, hint, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise error(f"{file}: not a safetensors file (a header of {length} bytes in {size})", hint)
        data = f.read(length)
    if len(data) != length:  # the file shrank while it was read
        raise error(f"{file}: ends inside its safetensors header (truncated)", hint)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{file}: its safetensors header is not JSON (not UTF-8)", hint) from None
    header = parse_json_text(text, f"{file}: its safetensors header is not JSON", error=error, hint=hint)
    return header, 8 + length, size


def _tensor(info: Any, base: int, size: int, bad: Any) -> StoredTensor:
    if not isinstance(info, dict):
        raise bad("has no description")
    shape, offsets, dtype = info.get("shape"), info.get("data_offsets"), info.get("dtype")
    if not (isinstance(dtype, str) and dtype in DTYPES):  # a list or a map is not hashable
        raise bad(f"has dtype {str(dtype)[:20]!r}, which nanopt does not read (it reads {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(_whole(d) and 0 <= d < MAX_DIMENSION for d in shape)):
        raise bad(f"has shape {str(shape)[:40]} (dimensions are whole numbers below 2**40)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= size - base):
        raise bad(f"has offsets {str(offsets)[:40]} outside the file")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][1]:
        raise bad(f"is {dtype} {tuple(shape)}, but {offsets[1] - offsets[0]:,} bytes are stored for it")
    return StoredTensor(dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_back_to_back(tensors: dict[str, StoredTensor], base: int, size: int, bad: Any) -> None:
    """The tensors' bytes tile the data from the header's end to the file's end, as safetensors writes them: two
    tensors sharing bytes would let a write through one change the other, and bytes no tensor owns (a gap, a tail)
    are either damage or something hidden in the file."""
    position, previous = base, None
    for name, tensor in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end)):
        if tensor.start != position:
            what = "overlaps" if tensor.start < position else "leaves unused bytes after"
            neighbour = f"tensor {previous[:80]!r}" if previous else "the header"
            raise bad(f"tensor {name[:80]!r} {what} {neighbour} (its data starts at byte {tensor.start - base:,} "
                      f"of the data, not {position - base:,})")
        position, previous = tensor.end, name
    if position != size:
        raise bad(f"holds {size - position:,} bytes after its last tensor (damaged, or not written by safetensors)")
