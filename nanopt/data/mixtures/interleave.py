"""Which source each sample of a data mixture comes from: a pure function of the global sample index.

A phase's weights become integer quotas over a short block of samples: the smallest block (up to BLOCK_LIMIT) in
which every weight is a whole number of samples (0.7 / 0.2 / 0.1: a block of 10 with 7, 2 and 1), or, for weights
no such block holds exactly, BLOCK_LIMIT samples shared by largest remainder (each weight off by at most half a
sample in BLOCK_LIMIT). The block's order is smooth weighted round-robin (nginx's): after each pick, every source
gains its quota of credit and the pick pays the block back, so each source's count in any prefix of the block is
within one sample of its share. Repeating the block therefore holds every source near its weight in every window of
samples, not only on average: the count of source i among any n consecutive samples is n * w_i +- 2.

Sample k of the run (numbered over all ranks, as nanopt.data.loaders.loader numbers them) belongs to the last phase that
starts at or before it; its source is the block's entry at its offset in the phase, and its index within that
source (how many samples the source gave before it, over all earlier phases too) is counted in O(1) from the quotas
and per-block prefix counts. Nothing here depends on the rank, the world size or what was read before: a resumed run
recomputes the same sources for the same sample indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK_LIMIT = 10_000  # samples in the longest block: weights are kept to 1 / 20,000 of a share


def quotas(weights: tuple[float, ...]) -> np.ndarray:
    """Integer samples per block for each weight (summing to the block's length); every positive weight gets at
    least one sample."""
    w = np.asarray(weights, dtype=np.float64)
    for block in range(1, BLOCK_LIMIT + 1):
        scaled = w * block
        if np.all(np.abs(scaled - np.round(scaled)) < 1e-9 * block):
            return np.round(scaled).astype(np.int64)
    scaled = w * BLOCK_LIMIT
    counts = np.floor(scaled).astype(np.int64)
    counts[(w > 0) & (counts == 0)] = 1  # a tiny positive weight still reads its source
    short = BLOCK_LIMIT - int(counts.sum())
    order = np.argsort(-(scaled - np.floor(scaled)), kind="stable") if short > 0 else np.argsort(-counts)
    for index in order[:abs(short)]:
        counts[index] += 1 if short > 0 else -1
    return counts


def round_robin(counts: np.ndarray) -> np.ndarray:
    """The block: source indices in smooth weighted round-robin order, counts[i] of source i."""
    block = int(counts.sum())
    credit = np.zeros(len(counts), dtype=np.int64)
    order = np.empty(block, dtype=np.int64)
    for position in range(block):
        credit += counts
        pick = int(np.argmax(credit))  # ties: the source listed first
        credit[pick] -= block
        order[position] = pick
    return order


@dataclass(frozen=True)
class _Phase:
    start: int  # its first global sample index
    counts: np.ndarray  # samples of each source per block
    order: np.ndarray  # the block
    before: np.ndarray  # [block + 1, sources]: samples of each source in the block's first j entries
    base: np.ndarray  # samples each source gave in all earlier phases

    def given(self, offset: int) -> np.ndarray:
        """Samples of each source among the phase's first `offset` samples."""
        whole, part = divmod(offset, len(self.order))
        return whole * self.counts + self.before[part]


class Interleave:
    """Sources and per-source indices of global sample indices, for phases starting at the given samples."""

    def __init__(self, starts: list[int], weights: list[tuple[float, ...]]) -> None:
        self.phases: list[_Phase] = []
        base = np.zeros(len(weights[0]), dtype=np.int64)
        for index, (start, phase_weights) in enumerate(zip(starts, weights, strict=True)):
            if index:
                previous = self.phases[-1]
                base = previous.base + previous.given(start - previous.start)
            counts = quotas(phase_weights)
            order = round_robin(counts)
            before = np.zeros((len(order) + 1, len(counts)), dtype=np.int64)
            before[np.arange(1, len(order) + 1), order] = 1
            self.phases.append(_Phase(start, counts, order, np.cumsum(before, axis=0), base))
        self.starts = np.asarray(starts, dtype=np.int64)

    def given_before(self, sample: int) -> np.ndarray:
        """Samples each source gave among global samples [0, sample)."""
        phase = self.phases[int(np.searchsorted(self.starts, sample, side="right")) - 1]
        return phase.base + phase.given(sample - phase.start)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within the source) of each global sample index."""
        sources, indices = np.empty_like(samples), np.empty_like(samples)
        which = np.searchsorted(self.starts, samples, side="right") - 1
        for number in np.unique(which):
            phase, chosen = self.phases[int(number)], which == number
            offsets = samples[chosen] - phase.start
            whole, part = np.divmod(offsets, len(phase.order))
            source = phase.order[part]
            sources[chosen] = source
            indices[chosen] = phase.base[source] + whole * phase.counts[source] + phase.before[part, source]
        return sources, indices
