"""Shuffling a streamed source at the document level with bounded memory (`nanopt tokenize --shuffle-buffer N`).

A corpus that arrives sorted (by date, by source, by length) would otherwise give sorted splits: val and test take
their held-out documents in source order until they have their tokens, so they would come from the start of the
source only, and training would read it in order. A shuffle buffer mixes the stream: it holds up to N documents,
and each document read replaces one drawn at random from the buffer (`random.Random(seed)`), which is emitted; at
the end the remaining documents come out in a random order. Memory is N documents (and one more), whatever the
corpus size. A document can only move earlier by at most N places, so a corpus is shuffled as a whole when N is at
least its number of documents; with a smaller N, documents mix within windows of about N.

Deterministic: the same source, buffer size and seed give the same order, hence the same shards.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

from nanopt.data.corpus.sources import SizeHint, Source

MAX_SHUFFLE_BUFFER = 100_000_000  # documents: beyond any machine's memory at a few KiB each


def shuffled(texts: Iterable[str], buffer_documents: int, seed: int) -> Iterator[str]:
    """`texts` in a seeded random order, never holding more than `buffer_documents` + 1 of them."""
    rng = random.Random(seed)
    buffer: list[str] = []
    for text in texts:
        buffer.append(text)
        if len(buffer) > buffer_documents:
            yield _take(buffer, rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    while buffer:
        yield buffer.pop()


def _take(buffer: list[str], index: int) -> str:
    """Remove and return buffer[index] in O(1): the last element moves into its place."""
    buffer[index], buffer[-1] = buffer[-1], buffer[index]
    return buffer.pop()


class ShuffledSource:
    """A source whose texts() come through the shuffle buffer; everything else is the source's own."""

    def __init__(self, source: Source, buffer_documents: int, seed: int) -> None:
        self.source, self.buffer_documents, self.seed = source, buffer_documents, seed
        self.kind = source.kind

    def texts(self) -> Iterator[str]:
        return shuffled(self.source.texts(), self.buffer_documents, self.seed)

    def text_files(self) -> list[Any]:
        return self.source.text_files() if hasattr(self.source, "text_files") else []

    def describe(self) -> dict[str, Any]:
        return {**self.source.describe(), "shuffle_buffer": self.buffer_documents, "shuffle_seed": self.seed}

    def size_hint(self) -> SizeHint:
        return self.source.size_hint()
