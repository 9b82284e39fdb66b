"""Per-split statistics of a tokenize run, in memory that does not grow with the corpus."""

from __future__ import annotations

from typing import Any

import numpy as np

EXACT_LENGTHS = 1 << 16  # documents shorter than this many tokens are counted exactly


class LengthHistogram:
    """Document lengths in tokens: exact counts below 2**16 tokens, power-of-two buckets above (rare documents).

    The median is exact unless the median document itself is 65536 tokens or longer; then it is the middle of its
    power-of-two bucket. Memory is a fixed 0.5 MiB however many documents there are.
    """

    def __init__(self) -> None:
        self.exact = np.zeros(EXACT_LENGTHS, dtype=np.int64)
        self.large = np.zeros(64, dtype=np.int64)  # bucket k holds lengths in [2**k, 2**(k+1))

    def add(self, lengths: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        small = lengths[lengths < EXACT_LENGTHS]
        self.exact += np.bincount(small, minlength=EXACT_LENGTHS)
        big = lengths[lengths >= EXACT_LENGTHS]
        if big.size:
            np.add.at(self.large, np.floor(np.log2(big)).astype(np.int64), 1)

    @property
    def count(self) -> int:
        return int(self.exact.sum() + self.large.sum())

    def median(self) -> float:
        n = self.count
        if n == 0:
            return 0.0
        return (self._value_at((n - 1) // 2) + self._value_at(n // 2)) / 2

    def _value_at(self, rank: int) -> float:
        """The value of the rank-th smallest length (0-based)."""
        exact_cumulative = np.cumsum(self.exact)
        if rank < exact_cumulative[-1]:
            return float(np.searchsorted(exact_cumulative, rank, side="right"))
        large_cumulative = exact_cumulative[-1] + np.cumsum(self.large)
        bucket = int(np.searchsorted(large_cumulative, rank, side="right"))
        return 1.5 * 2.0**bucket


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
                "median_document_tokens": self.lengths.median(), "max_token_id": self.max_token_id}
