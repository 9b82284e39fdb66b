"""Whether a local file is UTF-8 text, checked before anything is tokenized: in blocks, in constant memory.

A file that is not text at all (NUL bytes, or more than NOT_TEXT_SHARE of its first MiB undecodable: a binary, an
image, a compressed file under a text name, UTF-16) is refused; bytes that are not UTF-8 are counted per file (and
refused with --on-decode-error refuse, naming the offset).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanopt.errors import DataError

COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}  # suffix: fsspec compression name


@dataclass(frozen=True)
class TextFile:
    """A file a source decodes as UTF-8 text, and its name in messages and meta.json."""

    path: Path
    name: str
    # Whether reading replaces undecodable bytes with U+FFFD. `datasets` (5.x) opens compressed text files through
    # fsspec without passing encoding_errors on, so it decodes them strictly and would fail part-way instead.
    can_replace: bool = True



DECODE_ERROR_POLICIES = ("replace", "refuse")
_CHECK_BLOCK_BYTES = 1 << 20
# Random and compressed bytes are ~40-70% undecodable as UTF-8, text in a single-byte encoding of a non-Latin script
# (cp1251, ISO-8859-7) ~70%, Latin-1 prose under 10%. Above this share of the first block a file is refused as not
# UTF-8 text: replacing a third of it with U+FFFD would leave nothing worth training on.
NOT_TEXT_SHARE = 0.3
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # how the "surrogateescape" error handler spells a bad byte


def check_text_file(file: TextFile, refuse: bool = False) -> int:
    """How many bytes of a (decompressed) text or JSON file are not UTF-8; read in blocks, in constant memory.

    DataError if the file is not text at all (NUL bytes, or more than NOT_TEXT_SHARE undecodable, in its first
    MiB: a binary, an image, a compressed file under a text name, UTF-16), or, with refuse or when reading could
    not replace it, at the first undecodable byte, naming its offset.
    """
    undecodable = offset = 0
    pending = b""  # a multi-byte character cut by the block boundary
    for index, block in enumerate(_read_blocks(file)):
        data, final = pending + block, not block
        bad, consumed, first_bad = _undecodable_in(data, final)
        if index == 0:
            _check_looks_like_text(file, data, bad)
        if first_bad is not None and (refuse or not file.can_replace):
            raise _refusal(file, offset + first_bad, data[first_bad])
        undecodable += bad
        offset += consumed
        pending = data[consumed:]
    return undecodable


def _undecodable_in(data: bytes, final: bool) -> tuple[int, int, int | None]:
    """(undecodable bytes in data, bytes consumed: all but a character cut at the end unless final, the index of
    the first undecodable byte or None)."""
    if data.isascii():  # the fastest path: most text, and no character can be cut at the end
        return 0, len(data), None
    try:
        return 0, codecs.utf_8_decode(data, "strict", final)[1], None  # the fast path: valid UTF-8
    except UnicodeDecodeError as exc:
        first_bad = exc.start
    text, consumed = codecs.utf_8_decode(data, "surrogateescape", final)  # one escape character per bad byte
    return len(_ESCAPED_BYTE.findall(text)), consumed, first_bad


def _check_looks_like_text(file: TextFile, first_block: bytes, undecodable: int) -> None:
    if b"\0" in first_block:
        reason = "it has NUL bytes"
    elif first_block and undecodable / len(first_block) > NOT_TEXT_SHARE:
        reason = f"{undecodable / len(first_block):.0%} of its first {len(first_block):,} bytes are not UTF-8"
    else:
        return
    raise DataError(f"{file.name}: not UTF-8 text ({reason}): a binary file, an image, a compressed file under a "
                    "text name, or text in another encoding", "remove it from the source or narrow the glob (e.g. "
                    "'corpus/*.txt'); convert text in another encoding (UTF-16, cp1251, Latin-1) to UTF-8 first, "
                    "e.g. with iconv")


def _refusal(file: TextFile, offset: int, byte: int) -> DataError:
    decompressed = " of the decompressed text" if file.path.suffix.lower() in COMPRESSIONS else ""
    where = f"{file.name}: byte {offset}{decompressed} (0x{byte:02x}) is not UTF-8"
    if not file.can_replace:
        return DataError(f"{where}, and compressed text files are decoded strictly",
                         "decompress it (e.g. gunzip -k) so such bytes can be replaced with U+FFFD, or convert it to "
                         "UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    return DataError(f"{where} (--on-decode-error refuse)",
                     "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass --on-decode-error replace "
                     "to replace such bytes with U+FFFD (they are counted in meta.json)")


def _read_blocks(file: TextFile) -> Iterator[bytes]:
    """The file's bytes, decompressed as `datasets` decompresses them, in blocks; the last block is empty."""
    import fsspec

    compression = COMPRESSIONS.get(file.path.suffix.lower())
    try:
        with fsspec.open(str(file.path), "rb", compression=compression) as f:
            while block := f.read(_CHECK_BLOCK_BYTES):
                yield block
    except Exception as exc:  # OSError, zlib / lzma / zstd errors, an unsupported compression: no common base
        raise DataError(f"{file.name}: could not read: {type(exc).__name__}: {first_line(exc)}",
                        "check that the file is readable and, if compressed, complete (.zst needs the zstandard "
                        "package)") from None
    yield b""


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
