"""Per-split statistics of a tokenize run, in memory that grows only with the count of very long documents."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

EXACT_LENGTHS = 1 << 16  # documents shorter than this many tokens are counted in a fixed-size table


class LengthHistogram:
    """Document lengths in tokens, exactly: counts per length below 2**16 tokens, and each longer document's own
    length (a bucketed long document made the median of a split of one 145,911-token man page read 196,608).

    Memory: a fixed 0.5 MiB, plus 8 bytes per document of 65536 tokens or more, which its shard holds in at least
    128 KiB: at most 1/16384 of what is written.
    """

    def __init__(self) -> None:
        self.exact = np.zeros(EXACT_LENGTHS, dtype=np.int64)
        self.large = array("q")

    def add(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        small = lengths[lengths < EXACT_LENGTHS]
        self.exact += np.bincount(small, minlength=EXACT_LENGTHS)
        self.large.extend(lengths[lengths >= EXACT_LENGTHS].tolist())

    @property
    def count(self) -> int:
        return int(self.exact.sum()) + len(self.large)

    @property
    def longest(self) -> int:
        """The longest document's length (0 without documents)."""
        if self.large:
            return max(self.large)
        present = np.flatnonzero(self.exact)
        return int(present[-1]) if present.size else 0

    def median(self) -> float:
        n = self.count
        if n == 0:
            return 0.0
        large = sorted(self.large)
        return (self._value_at((n - 1) // 2, large) + self._value_at(n // 2, large)) / 2

    def _value_at(self, rank: int, large: list[int]) -> float:
        """The value of the rank-th smallest length (0-based); `large`: the long documents' lengths, sorted."""
        exact_cumulative = np.cumsum(self.exact)
        if rank < exact_cumulative[-1]:
            return float(np.searchsorted(exact_cumulative, rank, side="right"))
        return float(large[rank - int(exact_cumulative[-1])])


class SplitStats:
    """Counts for one split: documents, tokens (one EOS per document included), UTF-8 bytes, largest token id."""

    def __init__(self) -> None:
        self.documents = 0
        self.tokens = 0
        self.document_tokens = 0  # tokens excluding the EOS separators
        self.bytes = 0
        self.max_token_id = -1
        self.lengths = LengthHistogram()
        self._open_document_tokens = 0  # of a long document whose last piece is still to come

    def add(self, lengths: list[int], byte_counts: list[int], ends: list[bool], tokens: np.ndarray) -> None:
        """Pieces in order, with their token counts (without EOS) and bytes; `ends` marks each document's last
        piece. Most documents are one piece; the pieces of a long one may come over several calls."""
        finished = []
        for length, end in zip(lengths, ends, strict=True):
            self._open_document_tokens += length
            if end:
                finished.append(self._open_document_tokens)
                self._open_document_tokens = 0
        self.documents += len(finished)
        self.document_tokens += sum(lengths)
        self.tokens += int(tokens.size)
        self.bytes += sum(byte_counts)
        if tokens.size:
            self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self.lengths.add(np.asarray(finished, dtype=np.int64))

    def to_dict(self) -> dict[str, Any]:
        """Deterministic figures only (no times), as stored per split in meta.json."""
        return {"documents": self.documents, "tokens": self.tokens, "bytes": self.bytes,
                "bytes_per_token": round(self.bytes / self.tokens, 6) if self.tokens else 0.0,
                "mean_document_tokens": round(self.document_tokens / self.documents, 3) if self.documents else 0.0,
                "median_document_tokens": self.lengths.median(), "longest_document_tokens": self.lengths.longest,
                "max_token_id": self.max_token_id}
