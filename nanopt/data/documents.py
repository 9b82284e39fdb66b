"""Documents as the pipeline sees them: which split a document belongs to (a hash of its bytes), and the pieces a
long document is encoded in (cut where the token ids do not change, nanopt.data.tokenizer.piece_ends)."""

from __future__ import annotations

import hashlib
from typing import Any

from nanopt.data.tokenizer import piece_ends

# A longer document is encoded in pieces of at most this many characters (at most 1 MiB of UTF-8): unsplit, a
# 200 MB line needed ~27 GB of tokenizer work space.
MAX_PIECE_CHARS = 1 << 18


def split_of(data: bytes, val_fraction: float, test_fraction: float) -> str:
    """The split of a document: its BLAKE2b hash as a number in [0, 1) against the fractions.

    Depends on the text alone, so it is deterministic, independent of order and batch size, and identical copies
    of a document always land in the same split (no duplicate leaks from train into val).
    """
    return _split_of_hash(hashlib.blake2b(data, digest_size=8), val_fraction, test_fraction)


def _split_of_hash(digest: Any, val_fraction: float, test_fraction: float) -> str:
    position = int.from_bytes(digest.digest(), "little") / 2.0**64
    if position < val_fraction:
        return "val"
    return "test" if position < val_fraction + test_fraction else "train"


def document_pieces(raw: str, val_fraction: float, test_fraction: float) -> tuple[str, list[tuple[str, int]]]:
    """A document's split and the (text, UTF-8 byte count) pieces it is encoded in: one piece unless it is longer
    than MAX_PIECE_CHARS. The split hashes all of the document's bytes piece by piece, as split_of hashes them at
    once; cleaning is per character, so the pieces clean as the whole document does."""
    ends = piece_ends(raw, MAX_PIECE_CHARS)
    if len(ends) == 1:
        text, data = clean(raw)
        return split_of(data, val_fraction, test_fraction), [(text, len(data))]
    digest = hashlib.blake2b(digest_size=8)
    pieces = []
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        text, data = clean(raw[start:end])
        digest.update(data)
        pieces.append((text, len(data)))
    return _split_of_hash(digest, val_fraction, test_fraction), pieces


def is_empty(text: str) -> bool:
    return not text or text.isspace()


def clean(text: str) -> tuple[str, bytes]:
    """The text and its UTF-8 bytes. A Python string can hold lone surrogates (e.g. decoded with "surrogateescape"),
    which can be neither encoded nor tokenized; they become U+FFFD, as undecodable bytes in files do."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
        return text, text.encode("utf-8")
