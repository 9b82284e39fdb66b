"""A seeded permutation of [0, n) evaluated pointwise, in O(1) memory, vectorized with NumPy.

Shuffling tens of millions of training windows per rank by materializing `rng.permutation(n)` costs memory and
start-up time on every rank and every epoch. Instead, a balanced Feistel network is a bijection of [0, 4**k) for
any round function; "cycle walking" (re-applying it to values that land at or beyond n) restricts it to a
bijection of [0, n). The domain is at most 4n, so a value needs under four applications on average.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6  # enough rounds that neighbouring indices land far apart
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # multipliers of the splitmix64 finalizer
_MIX2 = np.uint64(0x94D049BB133111EB)


class FeistelPermutation:
    """perm(i) for i in [0, n): the same for the same (n, seed, epoch), different for another seed or epoch."""

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        if n < 1:
            raise ValueError(f"cannot permute an empty range (n={n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)  # both halves get the same width: the domain is 4**half >= n
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = [_round_key(seed, epoch, r) for r in range(ROUNDS)]

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        values = self._encrypt(indices.astype(np.uint64))
        outside = values >= self.n
        while outside.any():
            values[outside] = self._encrypt(values[outside])
            outside = values >= self.n
        return values.astype(np.int64)

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        left, right = values >> self.half, values & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def _round(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        mixed = half ^ key
        mixed = (mixed ^ (mixed >> np.uint64(30))) * _MIX1
        mixed = (mixed ^ (mixed >> np.uint64(27))) * _MIX2
        return (mixed ^ (mixed >> np.uint64(31))) & self.mask


def _round_key(seed: int, epoch: int, round_index: int) -> np.uint64:
    digest = hashlib.blake2b(f"{seed}/{epoch}/{round_index}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))
