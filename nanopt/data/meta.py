"""A dataset's meta.json, read and checked before any other file of the dataset is opened.

A dataset may come from someone else (a tar archive, a shared disk), and meta.json is the one file of it that is
not checked against a checksum: every field nanopt reads from it is checked here, where it is read, and a wrong one
is a DataError naming the file and the key. What is checked, and why:

- the file itself: a regular file of at most 64 MiB (nanopt.parsing.read_json: a named pipe would block the read,
  a huge file would be read whole), UTF-8 JSON nested at most 64 levels, without NaN or infinities (nanopt writes
  none);
- `format_version`, `vocab_size` (1 to 2**32: ids are uint32 at most), `eos_id` (an id of the vocabulary),
  `dtype` (uint16 / uint32, wide enough for the vocabulary), the sha256 of tokenizer.json (64 hex digits);
- per split, `documents`, `tokens` and `bytes` are integers from 0 to 2**63 - 1, and `bytes` is positive when
  `tokens` is (bits per byte divides by it: every token of a split comes from at least one byte of text),
  `max_token_id` fits the token dtype, and the shards' tokens add up to the split's;
- per shard, `file` is `SPLIT/NAME`, a plain file name in its split's directory (no `..`, no absolute path),
  `tokens` is an integer from 0 to 2**63 - 1, `sha256` 64 hex digits.

A number that is in range but false (a `bytes` count off by half) is not something a reader can tell; the shards
themselves are checked against their headers, sizes and checksums (nanopt.data.dataset).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from nanopt.data.shards import FORMAT, FORMAT_VERSION, token_dtype
from nanopt.errors import DataError
from nanopt.parsing import INT64_MAX, read_json, show_value
from nanopt.untrusted_text import shell_word

DTYPES = ("uint16", "uint32")
MAX_VOCAB_SIZE = 2**32  # token ids are stored as uint32 at most
_SHA256 = re.compile(r"[0-9a-f]{64}")


def retokenize_hint(path: Path) -> str:
    return f"re-create it: `nanopt tokenize SOURCE --out {shell_word(path)} --force` (no SOURCE: the built-in corpus)"


def read_meta(path: Path) -> dict[str, Any]:
    """The dataset directory's meta.json, every field nanopt reads from it checked (see the module docstring)."""
    meta_path = path / "meta.json"
    if not os.path.lexists(meta_path):
        raise DataError(f"{path}: incomplete dataset (no meta.json; was `nanopt tokenize` interrupted?)",
                        retokenize_hint(path))
    meta = read_json(meta_path, error=DataError, hint=retokenize_hint(path), finite=True,
                     contents_hint=retokenize_hint(path))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{meta_path}: not a nanopt dataset (format is not {FORMAT!r})", retokenize_hint(path))
    _check_meta(path, meta)
    return meta


def _check_meta(path: Path, meta: dict[str, Any]) -> None:
    check = _Checker(path)
    version = check.integer(meta, "format_version", 1, INT64_MAX)
    if version > FORMAT_VERSION:
        raise DataError(f"{check.where}: format_version {version} is newer than this nanopt reads ({FORMAT_VERSION})",
                        "upgrade nanopt, or re-tokenize with this version")
    vocab_size = check.integer(meta, "vocab_size", 1, MAX_VOCAB_SIZE)
    eos_id = check.integer(meta, "eos_id", 0, INT64_MAX)
    if eos_id >= vocab_size:
        check.fail(f"eos_id {eos_id} is outside vocab_size {vocab_size}")
    if meta.get("dtype") not in DTYPES:
        check.fail(f"key 'dtype' is {show_value(meta.get('dtype'))}, expected one of {DTYPES}")
    dtype = np.dtype(meta["dtype"])
    if dtype.itemsize < token_dtype(vocab_size).itemsize:
        check.fail(f"dtype {meta['dtype']} cannot hold a vocabulary of {vocab_size}")
    tokenizer = meta.get("tokenizer")
    if tokenizer is not None:
        check.sha256(check.mapping(meta, "tokenizer"), "sha256", "key 'tokenizer'")
    splits = meta.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        check.fail("key 'splits' missing or without a train split")
    for split, info in splits.items():
        _check_split(check, split, info, dtype)


def _check_split(check: _Checker, split: str, info: Any, dtype: np.dtype) -> None:
    where = f"split '{split}'"
    if not _plain_name(split):  # the name of the directory its shards are in
        check.fail(f"split {show_value(split)}: expected a plain directory name")
    if not isinstance(info, dict):
        check.fail(f"{where}: expected an object, got {show_value(info)}")
    tokens = check.integer(info, "tokens", 0, INT64_MAX, where)
    check.integer(info, "documents", 0, INT64_MAX, where)
    if check.integer(info, "bytes", 0, INT64_MAX, where) == 0 and tokens > 0:
        check.fail(f"{where}: key 'bytes' is 0 for {tokens:,} tokens (each token comes from at least one byte of "
                   "text)")
    if "max_token_id" in info:
        check.integer(info, "max_token_id", -1, np.iinfo(dtype).max, where)
    shards = info.get("shards")
    if not isinstance(shards, list):
        check.fail(f"{where}: key 'shards' is {show_value(shards)}, expected a list")
    total = sum(_check_shard(check, split, number, shard) for number, shard in enumerate(shards))
    if total != tokens:
        check.fail(f"{where}: shards hold {total:,} tokens but the split says {tokens:,}")


def _check_shard(check: _Checker, split: str, number: int, shard: Any) -> int:
    """The shard's token count, once its entry is checked."""
    where = f"split '{split}' shard {number}"
    if not isinstance(shard, dict):
        check.fail(f"{where}: expected an object, got {show_value(shard)}")
    file = shard.get("file")
    folder, _, name = file.partition("/") if isinstance(file, str) else ("", "", "")
    if folder != split or not _plain_name(name):
        check.fail(f"{where}: key 'file' is {show_value(file)}, expected '{split}/NAME', a file in the split's "
                   "own directory")
    check.sha256(shard, "sha256", where)
    return check.integer(shard, "tokens", 0, INT64_MAX, where)


def _plain_name(name: str) -> bool:
    """A file or directory name that stays where it is: no separator, not `.` or `..`, no NUL."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


class _Checker:
    """The one-line DataError of a field of one meta.json: file, where in it, what is wrong, how to fix it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = path / "meta.json"

    def fail(self, problem: str) -> None:
        raise DataError(f"{self.where}: {problem}", retokenize_hint(self.path))

    def integer(self, data: dict[str, Any], key: str, low: int, high: int, where: str = "") -> int:
        value = data.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            bound = "2**63 - 1" if high == INT64_MAX else f"{high:,}"
            found = f"is {show_value(value)}" if key in data else "is missing"
            self.fail(f"{where + ': ' if where else ''}key '{key}' {found}, expected an integer from {low:,} to "
                      f"{bound}")
        return value

    def mapping(self, data: dict[str, Any], key: str) -> dict[str, Any]:
        if not isinstance(data.get(key), dict):
            self.fail(f"key '{key}' is {show_value(data.get(key))}, expected an object")
        return data[key]

    def sha256(self, data: dict[str, Any], key: str, where: str) -> None:
        """A checksum is optional (None: nothing recorded), else 64 lowercase hex digits as sha256sum prints."""
        value = data.get(key)
        if value is not None and not (isinstance(value, str) and _SHA256.fullmatch(value)):
            self.fail(f"{where}: key '{key}' is {show_value(value)}, expected 64 hex digits")
