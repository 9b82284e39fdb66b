"""Local text and JSON files read without the `datasets` library, for a machine that does not have it (offline, or a
GPU image without it): nanopt.data.corpus.sources.FileSource reads through here when `import datasets` fails.

It yields the documents that `datasets`' own "text" and "json" builders yield for the options FileSource passes
them, in the same order, so the same files make the same shards either way (tests/test_plain_files.py compares
the two wherever `datasets` is installed):

- text: UTF-8 with undecodable bytes replaced by U+FFFD (check_text_file counted them first), universal newlines
  ("\\r\\n" and "\\r" read as "\\n"). sample_by "document": the whole file; "line": each line with its "\\n";
  "paragraph": the text split at "\\n\\n", empty pieces dropped.
- json: one JSON object per line (blank lines skipped), or a file that is one JSON array (of objects; or of
  strings, which are the "text" column); a leading UTF-8 BOM is dropped. A row without the text column is an empty
  document; a file none of whose rows has it is refused, naming the columns it has.
- compressed files (.gz, .bz2, .xz, .zst) are decompressed through fsspec, as `datasets` and check_text_file do.

Where the two can differ, only on input `datasets` would mangle: it may turn a column of mixed types into JSON
text, and parse a pretty-printed JSON object through pandas; here a value that is not a string is refused (as
nanopt.data.corpus.hf_datasets.as_texts refuses it) and a file must be JSON Lines or one array.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from nanopt.data.corpus.textcheck import COMPRESSIONS, first_line
from nanopt.errors import DataError

PLAIN_BUILDERS = ("text", "json")  # what this module reads; parquet and hub datasets need `datasets`
_BLOCK_CHARS = 10 << 20  # characters read at once for paragraphs (what `datasets` reads per chunk)
_LISTED_COLUMNS = 20
_PEEK_BYTES = 1 << 16  # read first, to tell a JSON array from JSON Lines


def datasets_installed() -> bool:
    """Whether the `datasets` library can be imported here (a broken install counts as missing: the plain reader
    gives the same documents)."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


def plain_values(builder: str, files: Iterable[Path], column: str, sample_by: str, spec: str) -> Iterator[Any]:
    """The text column's values of `files`, in order, as `datasets` would stream them (see the module docstring)."""
    if builder not in PLAIN_BUILDERS:
        raise needs_datasets(f"{spec}: reading {builder} files")
    for path in files:
        if builder == "text":
            yield from text_documents(path, sample_by)
        else:
            yield from _column_of(json_rows(path), column, path)


def needs_datasets(what: str) -> DataError:
    return DataError(f"{what} needs the `datasets` package, which is not installed",
                     "pip install datasets, or give local .txt / .json / .jsonl files (read without it)")


def check_column(column: str, names: Iterable[str], spec: str) -> None:
    names = list(names)
    if column not in names:
        raise DataError(f"{spec}: no text column '{column}' (columns: {', '.join(names) or 'none'})",
                        "name the column holding the text with --text-column")


# ------------------------------------------------------------------------------------------------------ text


def _open(path: Path, mode: str) -> IO[Any]:
    import fsspec

    compression = COMPRESSIONS.get(path.suffix.lower())
    if mode == "rt":  # the newline default (None) is universal newlines, as `datasets`' open() has it
        return fsspec.open(str(path), mode, compression=compression, encoding="utf-8", errors="replace").open()
    return fsspec.open(str(path), mode, compression=compression).open()


def text_documents(path: Path, sample_by: str) -> Iterator[str]:
    with _reading(path), _open(path, "rt") as f:
        if sample_by == "document":
            yield f.read()
        elif sample_by == "line":
            yield from f
        else:
            yield from _paragraphs(f)


def _paragraphs(f: IO[str]) -> Iterator[str]:
    """The text split at "\\n\\n", empty pieces dropped, in blocks: a separator is found wherever the blocks cut."""
    rest = ""
    while block := f.read(_BLOCK_CHARS):
        pieces = (rest + block).split("\n\n")
        rest = pieces.pop()
        yield from (piece for piece in pieces if piece)
    if rest:
        yield rest


# ------------------------------------------------------------------------------------------------------ json


def json_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The file's rows: JSON Lines, or one JSON array."""
    with _reading(path), _open(path, "rb") as f:
        first = f.read(_PEEK_BYTES)
        first = first[len(codecs.BOM_UTF8):] if first.startswith(codecs.BOM_UTF8) else first
        if first.lstrip().startswith(b"["):
            yield from _array_rows(first + f.read(), path)
            return
        # Lines split at b"\n" only: a JSON string may hold U+2028 and the other characters str.splitlines cuts at.
        lines = itertools.chain(io.BytesIO(first + f.readline()), f)
        for number, line in enumerate(lines, 1):
            text = line.decode("utf-8", errors="replace").strip()
            if text:
                yield _row(text, path, number)


def _row(text: str, path: Path, number: int) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise DataError(f"{path}: line {number} is not valid JSON ({exc})",
                        "a .jsonl file holds one JSON object per line; a .json file may also be one array") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}: line {number} holds a JSON {type(row).__name__}, not an object",
                        "a .jsonl file holds one JSON object per line, such as {\"text\": \"...\"}")
    return row


def _array_rows(data: bytes, path: Path) -> Iterator[dict[str, Any]]:
    try:
        items = json.loads(data.decode("utf-8", errors="replace"))
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})", "a .json file holds one array of objects, or one JSON "
                        "object per line") from None
    if not isinstance(items, list):  # e.g. "[1] [2]" fails above; kept for a decoder that returns otherwise
        raise DataError(f"{path}: not a JSON array", "a .json file holds one array of objects")
    objects = bool(items) and isinstance(items[0], dict)  # the first item decides, as in `datasets`
    for index, item in enumerate(items):
        if not objects:
            yield {"text": item}  # an array of strings is the "text" column
        elif isinstance(item, dict):
            yield item
        else:
            raise DataError(f"{path}: item {index} of the array is a JSON {type(item).__name__}, not an object",
                            "make every item an object such as {\"text\": \"...\"}")


def _column_of(rows: Iterator[dict[str, Any]], column: str, path: Path) -> Iterator[Any]:
    """Each row's value of `column` (None where a row lacks it); a file with rows none of which has it is refused."""
    any_row = found = False
    columns: dict[str, None] = {}  # those met so far, in order, for the error message
    for row in rows:
        any_row, found = True, found or column in row
        if not found and len(columns) < _LISTED_COLUMNS:
            columns.update(dict.fromkeys(list(row)[:_LISTED_COLUMNS]))
        yield row.get(column)
    if any_row and not found:
        check_column(column, columns, str(path))


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A failure to read or decompress the file becomes a DataError naming it."""
    try:
        yield
    except DataError:
        raise
    except Exception as exc:  # OSError, zlib / lzma / zstd errors: no common base class
        raise DataError(f"{path}: reading failed: {type(exc).__name__}: {first_line(exc)}",
                        "check that the file is readable and, if compressed, complete") from None
