"""Documents as the pipeline sees them: which split a document belongs to (a hash of its bytes, and how full its
split already is: SplitRule), and the pieces a long document is encoded in (cut where the token ids do not change,
nanopt.data.tokenizers.tokenizer.piece_ends)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nanopt.data.tokenizers.tokenizer import piece_ends

# A longer document is encoded in pieces of at most this many characters (at most 1 MiB of UTF-8): unsplit, a
# 200 MB line needed ~27 GB of tokenizer work space.
MAX_PIECE_CHARS = 1 << 18
HELD_OUT = ("val", "test")


def split_of(data: bytes, val_fraction: float, test_fraction: float) -> str:
    """The split a document's hash holds it out for ("val", "test"), or "train": its BLAKE2b hash as a number in
    [0, 1) against the fractions.

    Depends on the text alone, so it is deterministic, independent of order and batch size, and identical copies
    of a document always land in the same split (no duplicate leaks from train into val).
    """
    return hash_split(document_key(data), val_fraction, test_fraction)


def document_key(data: bytes) -> int:
    """A document's 64-bit BLAKE2b hash, as an integer: what split_of and SplitRule go by."""
    return _key(hashlib.blake2b(data, digest_size=8))


def _key(digest: Any) -> int:
    return int.from_bytes(digest.digest(), "little")


def hash_split(key: int, val_fraction: float, test_fraction: float) -> str:
    position = key / 2.0**64
    if position < val_fraction:
        return "val"
    return "test" if position < val_fraction + test_fraction else "train"


@dataclass
class SplitRule:
    """Where each document goes, in source order: deterministic, so the same source and settings give the same
    shards, whatever the batch size.

    A document's hash holds it out for val (below val_fraction) or test (the next test_fraction). A held-out
    document joins its split while the split has fewer tokens than its target (None: no target, every one joins),
    then train. A copy of a document that joined val or test joins it again, full or not, so no text is in both
    train and a held-out split; the keys kept for that are those of held-out documents only, which a target bounds.
    Past the --max-tokens budget train takes nothing, and only splits with a target still take documents: they are
    filled, not left with what happened to come before the budget.
    """

    val_fraction: float
    test_fraction: float
    val_tokens: int | None
    test_tokens: int | None
    _joined: dict[str, set[int]] = field(default_factory=lambda: {split: set() for split in HELD_OUT})

    def held_out_for(self, key: int) -> str:
        """The split a document's hash holds it out for, or "train" (before any target is looked at)."""
        return hash_split(key, self.val_fraction, self.test_fraction)

    def split_of_next(self, key: int, tokens: Mapping[str, int], past_budget: bool) -> str:
        """The split of the next document, given the tokens each split holds so far."""
        split = self.held_out_for(key)
        if split == "train":
            return split
        target = self.target(split)
        if target is None:
            return "train" if past_budget else split  # --val-fraction alone: every such document, to the budget
        if key in self._joined[split] or tokens[split] < target:
            self._joined[split].add(key)
            return split
        return "train"

    def target(self, split: str) -> int | None:
        return self.val_tokens if split == "val" else self.test_tokens

    def targeted(self) -> list[str]:
        """The held-out splits that take documents up to a target of tokens."""
        fractions = {"val": self.val_fraction, "test": self.test_fraction}
        return [split for split in HELD_OUT if fractions[split] > 0 and (self.target(split) or 0) > 0]

    def filling(self, tokens: Mapping[str, int]) -> bool:
        """Whether a split with a target is still short of it (reading goes on past the budget for it)."""
        return any(tokens[split] < self.target(split) for split in self.targeted())


def document_pieces(raw: str) -> tuple[int, list[tuple[str, int]]]:
    """A document's key (document_key) and the (text, UTF-8 byte count) pieces it is encoded in: one piece unless
    it is longer than MAX_PIECE_CHARS. The key hashes all of the document's bytes piece by piece, as document_key
    hashes them at once; cleaning is per character, so the pieces clean as the whole document does."""
    ends = piece_ends(raw, MAX_PIECE_CHARS)
    if len(ends) == 1:
        text, data = clean(raw)
        return document_key(data), [(text, len(data))]
    digest = hashlib.blake2b(digest_size=8)
    pieces = []
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        text, data = clean(raw[start:end])
        digest.update(data)
        pieces.append((text, len(data)))
    return _key(digest), pieces


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
