"""A random subset of a source's documents (`nanopt tokenize --sample FRACTION --sample-seed N`).

Each document is kept with probability FRACTION, decided by the seed and its position in the source's order alone
(the i-th draw of a PCG64 generator seeded with N), never by its text or by what was read before: the same source,
fraction and seed always keep the same documents, and a larger fraction with the same seed keeps a superset.
Documents are decided as they stream, so a hub dataset is sampled without being downloaded whole first; it is
still read through (a streamed dataset cannot skip ahead), unless --max-tokens stops the reading at its budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from nanopt.data.corpus.sources import SizeHint, Source
from nanopt.data.corpus.textcheck import TextFile

_DRAWS = 4096  # uniform draws made at once; the decisions do not depend on it


class SampledSource:
    """`inner`'s documents, each kept with probability `fraction` (see the module docstring)."""

    def __init__(self, inner: Source, fraction: float, seed: int) -> None:
        self.inner, self.fraction, self.seed = inner, fraction, seed
        self.kind = inner.kind

    def texts(self) -> Iterator[str]:
        import numpy as np

        generator = np.random.Generator(np.random.PCG64(self.seed))
        draws, used = generator.random(_DRAWS), 0
        for text in self.inner.texts():
            if used == _DRAWS:
                draws, used = generator.random(_DRAWS), 0
            keep = draws[used] < self.fraction
            used += 1
            if keep:
                yield text

    def text_files(self) -> list[TextFile]:
        return self.inner.text_files() if hasattr(self.inner, "text_files") else []

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "sample": {"fraction": self.fraction, "seed": self.seed}}

    def size_hint(self) -> SizeHint:
        hint = self.inner.size_hint()
        return SizeHint(bytes=None if hint.bytes is None else int(hint.bytes * self.fraction),
                        documents=None if hint.documents is None else round(hint.documents * self.fraction))
