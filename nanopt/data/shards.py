"""The shard format: plain .npy files of uint16 / uint32 token ids, written incrementally, read through memory maps.

A shard is a standard NumPy .npy file (version 1.0, 1-D, little-endian), so `np.load(path, mmap_mode="r")` opens it
anywhere. The writer reserves the 128-byte header that NumPy itself uses for 1-D arrays, streams tokens after it,
and fills the header in when the shard is closed, so a shard is never held in memory. A split's shards are cut
at `shard_tokens` tokens regardless of document boundaries; documents end with the EOS token.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from nanopt.errors import DataError
from nanopt.files import make_dir, open_file
from nanopt.parsing import open_regular

FORMAT = "nanopt-tokens"  # meta.json "format": what kind of directory this is
FORMAT_VERSION = 1  # meta.json "format_version": bumped when readers of older versions would misread it
HEADER_BYTES = 128
_MAGIC = b"\x93NUMPY\x01\x00"
_PREFIX_BYTES = len(_MAGIC) + 2  # magic, version, and the little-endian uint16 header length


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, so a vocabulary of up to 65536 tokens; larger ones need uint32."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).name  # "uint16" / "uint32", as stored in meta.json


def npy_header(dtype: np.dtype, length: int) -> bytes:
    """The .npy v1.0 header of a 1-D array, padded to HEADER_BYTES exactly as NumPy pads it."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({length},), }}"
    padding = HEADER_BYTES - _PREFIX_BYTES - len(text) - 1
    if padding < 0:  # impossible for any length below 10**40
        raise ValueError(f"shape {length} does not fit a {HEADER_BYTES}-byte header")
    body = text.encode("latin1") + b" " * padding + b"\n"
    return _MAGIC + struct.pack("<H", len(body)) + body


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the dataset directory, e.g. "train/shard-00000.npy"
    tokens: int
    sha256: str  # of the whole file, as `sha256sum` prints it

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "sha256": self.sha256}


class SplitWriter:
    """Appends one split's tokens to numbered shards of at most `shard_tokens` tokens each."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), shard_tokens
        make_dir(root / split)  # in the staging directory nanopt made
        self.shards: list[ShardInfo] = []
        self._file: BinaryIO | None = None
        self._name = ""
        self._filled = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        while tokens.size:
            if self._file is None:
                self._open_next()
            room = self.shard_tokens - self._filled
            self._file.write(tokens[:room].tobytes())
            self._filled += min(room, tokens.size)
            tokens = tokens[room:]
            if self._filled == self.shard_tokens:
                self._close_current()

    def close(self) -> list[ShardInfo]:
        if self._file is not None:
            self._close_current()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open_next(self) -> None:
        self._name = f"{self.split}/shard-{len(self.shards):05d}.npy"
        self._file = open_file(self.root / self._name, "wb")
        self._file.write(b"\0" * HEADER_BYTES)  # an invalid header until the shard is complete
        self._filled = 0

    def _close_current(self) -> None:
        self._file.seek(0)
        self._file.write(npy_header(self.dtype, self._filled))
        self._file.close()
        self._file = None
        self.shards.append(ShardInfo(self._name, self._filled, sha256_file(self.root / self._name)))


DAMAGED_HINT = "the dataset is damaged or was replaced; re-run `nanopt tokenize ... --force`"


def sha256_file(path: Path, chunk_bytes: int = 1 << 22, on_chunk: Callable[[int], None] | None = None,
                what: str = "file") -> str:
    """The file's sha256 as `sha256sum` prints it; `on_chunk` hears the size of each chunk read (for progress).
    Anything but a regular file is a DataError, never a read that blocks (nanopt.parsing.open_regular)."""
    digest = hashlib.sha256()
    with open_regular(path, DataError, DAMAGED_HINT, what) as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardHeader:
    """What a shard's .npy header says, and the size of the file it heads."""

    dtype: np.dtype
    length: int
    offset: int  # where the tokens start
    file_bytes: int


def read_header(path: Path) -> ShardHeader:
    """A shard's .npy header, without reading its data; DataError if the shard is not a regular file holding a
    1-D .npy (nothing else is opened: a named pipe would block)."""
    with open_regular(path, DataError, DAMAGED_HINT, "shard file") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except (ValueError, OSError, SyntaxError) as exc:
            raise DataError(f"{path}: not a valid .npy shard ({exc})", DAMAGED_HINT) from None
        header = ShardHeader(np.dtype(dtype), int(shape[0]) if len(shape) == 1 else -1, f.tell(),
                             os.fstat(f.fileno()).st_size)
    if len(shape) != 1 or fortran:
        raise DataError(f"{path}: expected a 1-D token array, found shape {shape}",
                        "re-run `nanopt tokenize ... --force`")
    return header


def map_shard(path: Path, header: ShardHeader) -> np.ndarray:
    """The shard's tokens as a read-only memory map of the regular file its (checked) header describes."""
    with open_regular(path, DataError, DAMAGED_HINT, "shard file") as f:
        try:
            return np.memmap(f, dtype=header.dtype, mode="r", offset=header.offset, shape=(header.length,))
        except (ValueError, OSError) as exc:  # shorter than its header says: changed since the dataset was opened
            raise DataError(f"{path}: cannot map its tokens ({exc})", DAMAGED_HINT) from None
