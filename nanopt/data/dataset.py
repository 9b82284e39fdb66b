"""Opening a dataset directory made by `nanopt tokenize`, and checking it against a model.

    data/NAME/
      meta.json        format, format_version, vocab_size, eos_id, eos_token, dtype, tokenizer (description and
                       sha256), splits: {train, val, test: documents, tokens, bytes, bytes_per_token, document length
                       stats, max_token_id, shards: [{file, tokens, sha256}]}, source, settings, stats, created
      tokenizer.json   the exact tokenizer used
      train/ val/ test/shard-00000.npy ...   1-D .npy arrays of token ids, documents each followed by eos_id

A split is one token stream: its shards concatenated in order.

What is checked, and what it costs (sha256 runs at roughly 0.5-1.5 GB/s on one core):
- `open`, always: every field of meta.json nanopt reads (nanopt.data.meta: types, ranges, shard paths); every
  shard's .npy header, dtype, length and file size against meta.json (a stat and a 128-byte read per shard:
  microseconds); the sha256 of tokenizer.json (a few MB at most: milliseconds). A truncated, padded, replaced or
  re-typed shard and any change to tokenizer.json fail here. Shards and tokenizer.json must be regular files
  (links to one are followed): a named pipe, device or directory in their place is refused without blocking.
- `open`, when the shards total at most VERIFY_AT_OPEN_BYTES (1 GiB: about 1-2 s): the sha256 of every shard,
  so a shard rewritten in place with the same size fails too. Larger datasets skip this at open; their token ids
  are still range-checked as the loader reads them (nanopt.data.loaders.loader), and `verify` hashes everything on
  demand, with a progress callback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nanopt.data.meta import read_meta, retokenize_hint
from nanopt.data.shards import ShardHeader, map_shard, read_header, sha256_file
from nanopt.errors import DataError
from nanopt.parsing import path_kind
from nanopt.untrusted_text import shell_word

if TYPE_CHECKING:
    from nanopt.config import ModelConfig, RunConfig

VERIFY_AT_OPEN_BYTES = 1 << 30  # shards up to this total are hashed whole at open: about 1-2 s

# verify()'s progress: (bytes hashed so far, bytes to hash in all)
VerifyProgress = Callable[[int, int], None]


def open_run_dataset(run: RunConfig, *, verify_up_to_bytes: int = VERIFY_AT_OPEN_BYTES, path: Path | None = None,
                     given: str | None = None) -> TokenDataset:
    """The dataset train.json's `data` names (or one source of its mixture: `path` as resolved, `given` as written),
    relative to the run directory; a missing one is a DataError that names both the value in train.json and the
    path it was looked for at."""
    path, given = (run.data_dir, run.train.data) if path is None else (path, given)
    if path_kind(path, DataError, "give the dataset directory made by `nanopt tokenize`") == "missing":
        if "data" in run.set_on_command_line:  # made absolute from the current directory: train.json is not to blame
            raise DataError(f"{path}: dataset directory not found (--set data: relative to the current directory)",
                            f"make it with `nanopt tokenize SOURCE --out {shell_word(path)}`, or correct --set data")
        relative = "" if Path(given).is_absolute() else ", relative to the run directory"
        raise DataError(f"{path}: dataset directory not found ({run.run_dir / 'train.json'} 'data': "
                        f"{given!r}{relative})", _missing_data_hint(run, path, given))
    return TokenDataset.open(path, verify_up_to_bytes=verify_up_to_bytes)


def _missing_data_hint(run: RunConfig, path: Path, given: str) -> str:
    data = Path(given)
    if not data.is_absolute() and (data / "meta.json").is_file():
        # Written before data paths were relative to the run directory: it is there from the current directory.
        return (f"the dataset is at {data} from the current directory: write \"data\": "
                f"\"{os.path.relpath(data, run.run_dir)}\" (or an absolute path) in train.json")
    return f"make it with `nanopt tokenize SOURCE --out {shell_word(path)}`, or correct 'data' in train.json"


class TokenDataset:
    """A validated dataset directory; the shards of each split are memory-mapped on first use and kept open."""

    def __init__(self, path: Path, meta: dict[str, Any], tokenizer_sha256: str,
                 headers: dict[Path, ShardHeader]) -> None:
        self.path = path
        self.meta = meta
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.dtype = np.dtype(meta["dtype"])
        self.tokenizer_path = path / "tokenizer.json"
        self.tokenizer_sha256 = tokenizer_sha256  # of the file as found at open (it matched meta.json)
        self._headers = headers  # of every shard, checked against meta.json at open
        self._streams: dict[str, TokenStream] = {}
        self._tokenizer: Any = None

    @classmethod
    def open(cls, path: Path | str, *, verify_up_to_bytes: int = VERIFY_AT_OPEN_BYTES) -> TokenDataset:
        """Every cheap check, and every shard's sha256 when the shards total at most `verify_up_to_bytes` (see the
        module docstring for what each costs); DataError naming the first file that does not match meta.json."""
        path = Path(path)
        make_it = f"make it with `nanopt tokenize SOURCE --out {shell_word(path)}` (no SOURCE: the built-in corpus)"
        kind = path_kind(path, DataError, "give the dataset directory made by `nanopt tokenize`, e.g. data/stdlib")
        if kind == "file":
            raise DataError(f"{path}: is a file, not a directory (a dataset is a directory)",
                            "give the dataset directory made by `nanopt tokenize` that holds meta.json")
        if kind == "missing":
            raise DataError(f"{path}: dataset directory not found", make_it)
        meta = read_meta(path)  # every field checked: nothing below reads an unchecked value
        tokenizer_sha256 = _check_tokenizer(path, meta)
        headers = {path / shard["file"]: _check_shard(path, shard, np.dtype(meta["dtype"]))
                   for info in meta["splits"].values() for shard in info["shards"]}
        dataset = cls(path, meta, tokenizer_sha256, headers)
        shards = dataset._shard_checksums()
        if sum(header.file_bytes for header in headers.values()) <= verify_up_to_bytes:
            _check_sha256(path, shards)
        return dataset

    @property
    def splits(self) -> list[str]:
        return list(self.meta["splits"])

    def _split(self, split: str) -> dict[str, Any]:
        if split not in self.meta["splits"]:
            raise DataError(f"{self.path}: no split '{split}' (has {', '.join(self.splits)})", retokenize_hint(
                self.path))
        return self.meta["splits"][split]

    def split_tokens(self, split: str) -> int:
        return int(self._split(split)["tokens"])

    def split_documents(self, split: str) -> int:
        return int(self._split(split)["documents"])

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes of the split's text per token (EOS separators counted as tokens), for bits per byte."""
        info = self._split(split)
        if not info["tokens"]:
            raise DataError(f"{self.path}: split '{split}' is empty", retokenize_hint(self.path))
        return info["bytes"] / info["tokens"]  # both checked at open: at most 2**63 - 1, bytes > 0 with tokens

    def max_token_id(self) -> int:
        return max((int(info.get("max_token_id", -1)) for info in self.meta["splits"].values()), default=-1)

    @property
    def id_limit(self) -> int:
        """Every token id of the dataset is below this: its vocabulary size (or past it, the largest id meta.json
        records, for tokenizers whose ids have gaps). A model needs at least this many embedding rows."""
        return max(self.vocab_size, self.max_token_id() + 1)

    def stream(self, split: str) -> TokenStream:
        """The split's shards as one token stream (memory maps, opened once)."""
        if split not in self._streams:
            files = [self.path / shard["file"] for shard in self._split(split)["shards"]]
            self._streams[split] = TokenStream([map_shard(f, self._headers[f]) for f in files], files)
        return self._streams[split]

    def tokenizer(self) -> Any:
        """The parsed tokenizers.Tokenizer, read once. Commands that need it call this when they open the dataset,
        so an unreadable file fails before their expensive work rather than after it."""
        if self._tokenizer is None:
            from nanopt.data.tokenizers.tokenizer import read_tokenizer_file

            self._tokenizer = read_tokenizer_file(self.tokenizer_path, retokenize_hint(self.path))
        return self._tokenizer

    def verify(self, progress: VerifyProgress | None = None) -> None:
        """Check the sha256 of tokenizer.json and of every shard against meta.json. Reads every byte: about 1-2 s
        per GiB; `progress` hears (bytes hashed, bytes in all) after each chunk."""
        expected = _recorded_tokenizer_sha256(self.meta)
        _check_sha256(self.path, [(self.tokenizer_path, expected), *self._shard_checksums()], progress)

    def _shard_checksums(self) -> list[tuple[Path, str | None]]:
        return [(self.path / shard["file"], shard.get("sha256")) for info in self.meta["splits"].values()
                for shard in info["shards"]]


class TokenStream:
    """Shards read as one concatenated stream; reads that cross shard boundaries are stitched together."""

    def __init__(self, arrays: list[np.ndarray], files: list[Path]) -> None:
        self.arrays = arrays
        self.files = files
        self.ends = np.cumsum([len(a) for a in arrays], dtype=np.int64)
        self.total = int(self.ends[-1]) if arrays else 0

    def locate(self, position: int) -> tuple[int, int]:
        """(shard index, offset in that shard) of a stream position."""
        shard = int(np.searchsorted(self.ends, position, side="right"))
        return shard, position - (int(self.ends[shard - 1]) if shard else 0)

    def read(self, start: int, out: np.ndarray) -> None:
        """Fill `out` with tokens [start, start + len(out)) of the stream."""
        position, filled = start, 0
        while filled < len(out):
            shard, offset = self.locate(position)
            piece = self.arrays[shard][offset:offset + len(out) - filled]
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            position += len(piece)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """An int64 array [len(starts), length]: row i holds tokens [starts[i], starts[i] + length)."""
        batch = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts):
            if start < 0 or start + length > self.total:
                raise IndexError(f"window [{start}, {start + length}) outside a stream of {self.total} tokens")
            self.read(int(start), batch[row])
        return batch


def _check_shard(path: Path, shard: dict[str, Any], dtype: np.dtype) -> ShardHeader:
    file = path / shard["file"]
    header = read_header(file)
    if header.dtype != dtype:
        raise DataError(f"{file}: tokens are {header.dtype.name} but meta.json says {dtype.name}",
                        retokenize_hint(path))
    if header.length != shard["tokens"]:
        raise DataError(f"{file}: holds {header.length} tokens but meta.json says {shard['tokens']}",
                        retokenize_hint(path))
    expected_size = header.offset + header.length * dtype.itemsize
    if header.file_bytes != expected_size:
        raise DataError(f"{file}: {header.file_bytes} bytes, expected {expected_size} (truncated or padded)",
                        retokenize_hint(path))
    return header


def _recorded_tokenizer_sha256(meta: dict[str, Any]) -> str | None:
    tokenizer = meta.get("tokenizer")
    return tokenizer.get("sha256") if isinstance(tokenizer, dict) else None


def _check_tokenizer(path: Path, meta: dict[str, Any]) -> str:
    """The sha256 of tokenizer.json, which must be the one meta.json records (the file is small: milliseconds)."""
    file = path / "tokenizer.json"
    if not os.path.lexists(file):
        raise DataError(f"{path}: tokenizer.json is missing", retokenize_hint(path))
    found, expected = sha256_file(file, what="tokenizer file"), _recorded_tokenizer_sha256(meta)
    if expected is not None and found != expected:
        raise _checksum_mismatch(path, file)
    return found


def _check_sha256(path: Path, files: list[tuple[Path, str | None]], progress: VerifyProgress | None = None) -> None:
    """DataError naming the first file whose sha256 is not the one meta.json records (None: nothing recorded)."""
    files = [(file, expected) for file, expected in files if expected is not None]
    total, done = sum(_size(file) for file, _ in files), 0

    def advance(chunk_bytes: int) -> None:
        nonlocal done
        done += chunk_bytes
        if progress is not None:
            progress(done, total)

    for file, expected in files:
        if sha256_file(file, on_chunk=advance) != expected:
            raise _checksum_mismatch(path, file)


def _size(file: Path) -> int:
    """For progress only: a stat never blocks, whatever the file; one that is gone fails when it is read."""
    try:
        return os.stat(file).st_size
    except OSError:
        return 0


def _checksum_mismatch(path: Path, file: Path) -> DataError:
    return DataError(f"{file}: checksum mismatch (changed since `nanopt tokenize` wrote it: meta.json records "
                     "another sha256)", retokenize_hint(path))


def check_compatible(dataset: TokenDataset, model_vocab_size: int) -> None:
    """Every token id of the dataset must be an embedding row of the model (a larger model vocab is fine)."""
    needed = dataset.id_limit
    if needed > model_vocab_size:
        padded = -(-needed // 64) * 64
        raise DataError(f"{dataset.path}: its tokenizer has {needed:,} token ids but the model's vocab_size is "
                        f"{model_vocab_size:,}",
                        f"set vocab_size to at least {needed} in model.json (e.g. {padded}, a multiple of 64), or "
                        f"tokenize with a tokenizer of at most {model_vocab_size} tokens (--vocab-size)")


def check_document_eos(dataset: TokenDataset, model: ModelConfig) -> None:
    """With document_masking, the model's eos_token_id must be the dataset's EOS: another id would never end a
    document (attention would cross every boundary) or would split documents at an ordinary token."""
    if model.document_masking and model.eos_token_id != dataset.eos_id:
        raise DataError(f"model.json: key 'eos_token_id': {model.eos_token_id} is not the EOS of the dataset "
                        f"{dataset.path} ({dataset.eos_id}), so document masking would not find its documents",
                        f"set \"eos_token_id\": {dataset.eos_id} in model.json")
