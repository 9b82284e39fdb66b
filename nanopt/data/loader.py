"""The resumable distributed loader used by train, eval, find-batch and profile.

A split is one token stream cut into windows of seq_len + 1 tokens with stride seq_len (inputs are a window's
first seq_len tokens, targets the last seq_len). Window w starts at token w * seq_len; the split has
(tokens - 1) // seq_len of them.

Training order: sample k of the run is window perm_e(k mod W) of epoch e = k // W, where perm_e is a seeded
Feistel permutation (O(1) memory) keyed by (seed, e), so each epoch is a fresh shuffle.

Sample assignment: optimizer step s consumes G = micro_batch_size x grad_accum x world_size samples, namely
[s*G, (s+1)*G); micro-step m of rank r takes the B samples starting at s*G + (m*world_size + r)*B. The samples of a
step therefore depend only on G: one rank with grad_accum 2 and two ranks with grad_accum 1 train on the same
samples, and a run may resume on another number of ranks (or micro-batch size) at a step boundary.

Evaluation reads a fixed slice instead: the first windows of the split, in order, the same number of batches on
every rank (so no rank waits alone at a collective), disjoint across ranks.

Token ids are checked here, for every command that reads batches (train, eval, find-batch, profile): an id past the
embedding table would crash the forward pass (on CUDA as a device-side assert), so it is a DataError naming the
shard instead. Every rank checks what all ranks will read, not only its own share, so all raise together and none
waits alone at a collective: the evaluation slice when it is built, each training step's samples before its first
micro-batch (one extra read of the step's tokens, from the page cache: milliseconds next to the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nanopt.data.dataset import TokenDataset, TokenStream, check_budget, check_compatible, retokenize_hint
from nanopt.data.permutation import FeistelPermutation
from nanopt.errors import DataError, ResumeError

__all__ = ["EvalBatches", "TrainLoader", "check_budget", "check_compatible", "check_token_ids", "eval_batches"]

STATE_VERSION = 1
CHECK_CHUNK_TOKENS = 1 << 22  # tokens range-checked per read: bounds the check's memory (32 MiB as int64)


def _windows_in(stream: TokenStream, seq_len: int) -> int:
    return max(0, (stream.total - 1) // seq_len)


def _to_tensors(windows: np.ndarray) -> tuple[Any, Any]:
    import torch

    inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
    return inputs, targets


def check_token_ids(dataset: TokenDataset, split: str, stream: TokenStream, starts: np.ndarray, length: int,
                    when: str = "") -> None:
    """DataError unless every token of the windows [start, start + length) is below the dataset's id limit."""
    limit = dataset.id_limit
    rows = max(1, CHECK_CHUNK_TOKENS // length)
    for first in range(0, len(starts), rows):
        chunk = starts[first:first + rows]
        windows = stream.windows(chunk, length)
        if windows.size and windows.max() >= limit:
            row, column = (int(i) for i in np.argwhere(windows >= limit)[0])
            shard, offset = stream.locate(int(chunk[row]) + column)
            raise DataError(f"{dataset.path}: split '{split}' holds token id {int(windows[row, column]):,}{when}, "
                            f"outside the dataset's vocabulary of {limit:,} ids ({stream.files[shard]}, token "
                            f"{offset:,})",
                            f"the shard does not hold what its tokenizer wrote; {retokenize_hint(dataset.path)}")


def _check_layout(seq_len: int, micro_batch_size: int, rank: int, world_size: int) -> None:
    if seq_len < 1 or micro_batch_size < 1 or world_size < 1:
        raise ValueError(f"seq_len {seq_len}, micro_batch_size {micro_batch_size} and world_size {world_size} "
                         "must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")


class TrainLoader:
    """Deterministic, shuffled, disjoint-across-ranks micro-batches; state_dict() resumes at the very next one."""

    def __init__(self, dataset: TokenDataset, split: str, seq_len: int, micro_batch_size: int, grad_accum: int,
                 rank: int, world_size: int, seed: int) -> None:
        _check_layout(seq_len, micro_batch_size, rank, world_size)
        if grad_accum < 1:
            raise ValueError(f"grad_accum {grad_accum} must be positive")
        self.dataset, self.split, self.seq_len, self.seed = dataset, split, seq_len, seed
        self.micro_batch_size, self.grad_accum, self.rank, self.world_size = (micro_batch_size, grad_accum, rank,
                                                                              world_size)
        self.stream = dataset.stream(split)
        self.num_windows = _windows_in(self.stream, seq_len)
        if self.num_windows < 1:
            raise DataError(f"{dataset.path}: split '{split}' has {self.stream.total:,} tokens, fewer than one "
                            f"training sequence of seq_len + 1 = {seq_len + 1:,}",
                            "tokenize a larger corpus or lower seq_len")
        self.step = 0  # optimizer steps completed
        self.micro_step = 0  # micro-steps of the current step already handed out
        self._permutation: FeistelPermutation | None = None
        self._checked_step = -1  # the last step whose token ids were checked
        self._check_step()  # the first step's now, so plainly bad data fails before any work (a profiler, a model)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (0 during the first pass over the split)."""
        return self._first_sample() // self.num_windows

    def _first_sample(self) -> int:
        return (self.step * self.samples_per_step
                + (self.micro_step * self.world_size + self.rank) * self.micro_batch_size)

    def next_batch(self) -> tuple[Any, Any]:
        """(inputs, targets): int64 CPU tensors of shape [micro_batch_size, seq_len]."""
        if self._checked_step != self.step:  # also after resuming in the middle of a step
            self._check_step()
        first = self._first_sample()
        samples = np.arange(first, first + self.micro_batch_size, dtype=np.int64)
        self.micro_step += 1
        if self.micro_step == self.grad_accum:
            self.step, self.micro_step = self.step + 1, 0
        starts = self._windows(samples) * self.seq_len
        return _to_tensors(self.stream.windows(starts, self.seq_len + 1))

    def _check_step(self) -> None:
        """Check the token ids of every sample of the step, on every rank: the same DataError on all ranks."""
        first = self.step * self.samples_per_step
        starts = self._windows(np.arange(first, first + self.samples_per_step, dtype=np.int64)) * self.seq_len
        check_token_ids(self.dataset, self.split, self.stream, starts, self.seq_len + 1, f" at step {self.step + 1}")
        self._checked_step = self.step

    def _windows(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(samples, self.num_windows)
        windows = np.empty_like(samples)
        for epoch in np.unique(epochs):  # a micro-batch may straddle two epochs
            chosen = epochs == epoch
            windows[chosen] = self._permutation_of(int(epoch))(positions[chosen])
        return windows

    def _permutation_of(self, epoch: int) -> FeistelPermutation:
        if self._permutation is None or self._permutation_epoch != epoch:
            self._permutation = FeistelPermutation(self.num_windows, self.seed, epoch)
            self._permutation_epoch = epoch
        return self._permutation

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable position. It holds no rank: every rank restores from the same state."""
        return {"version": STATE_VERSION, "split": self.split, "seq_len": self.seq_len, "seed": self.seed,
                "num_windows": self.num_windows, "samples_per_step": self.samples_per_step, "step": self.step,
                "micro_step": self.micro_step, "micro_batch_size": self.micro_batch_size,
                "grad_accum": self.grad_accum, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            saved = {key: state[key] for key in ("split", "seq_len", "seed", "num_windows", "samples_per_step",
                                                 "step", "micro_step", "micro_batch_size", "grad_accum",
                                                 "world_size")}
        except (KeyError, TypeError):
            raise ResumeError("the checkpoint's data-loader state is malformed",
                              "resume from another checkpoint or start a new run") from None
        for key in ("split", "seq_len", "seed", "num_windows", "samples_per_step"):
            if saved[key] != getattr(self, key):
                raise ResumeError(f"data loader: {key} was {saved[key]!r} in the checkpoint and is "
                                  f"{getattr(self, key)!r} now", _resume_hint(key))
        same_layout = all(saved[k] == getattr(self, k) for k in ("micro_batch_size", "grad_accum", "world_size"))
        if saved["micro_step"] and not same_layout:
            raise ResumeError("the checkpoint was saved in the middle of an optimizer step, so it can only resume "
                              "with the same micro_batch_size, gradient accumulation and world size",
                              f"use micro_batch_size {saved['micro_batch_size']} on {saved['world_size']} rank(s)")
        self.step, self.micro_step = int(saved["step"]), int(saved["micro_step"])


def _resume_hint(key: str) -> str:
    if key in ("num_windows", "split"):
        return "the dataset changed since the checkpoint: point train.json at the original dataset"
    return "restore the original setting, or start a new run directory"


def eval_batches(dataset: TokenDataset, split: str, seq_len: int, micro_batch_size: int, rank: int,
                 world_size: int, max_tokens: int) -> EvalBatches:
    """This rank's share of a fixed evaluation slice: the first windows of the split, in order.

    `max_tokens` is the total over all ranks, so the same windows are evaluated on any number of ranks when it
    divides evenly. Every rank gets the same number of batches (at least one); DataError if the split is too small
    or the slice holds a token id past the vocabulary.
    """
    _check_layout(seq_len, micro_batch_size, rank, world_size)
    stream = dataset.stream(split)
    per_batch_round = micro_batch_size * world_size  # windows consumed when every rank takes one batch
    available = _windows_in(stream, seq_len) // per_batch_round
    if available < 1:
        needed = per_batch_round * seq_len + 1
        raise DataError(f"{dataset.path}: split '{split}' has {stream.total:,} tokens; one evaluation batch per "
                        f"rank needs {world_size} x {micro_batch_size} x {seq_len} + 1 = {needed:,}",
                        f"tokenize with a larger --{split}-fraction or a bigger corpus, or lower micro_batch_size "
                        "or seq_len")
    count = min(max(1, max_tokens // (per_batch_round * seq_len)), available)
    # The whole slice, on every rank: a bad id in another rank's share stops this rank too.
    check_token_ids(dataset, split, stream, np.arange(count * per_batch_round, dtype=np.int64) * seq_len, seq_len + 1)
    return EvalBatches(stream, seq_len, micro_batch_size, rank, world_size, count)


class EvalBatches(Sequence):
    """A sized, re-iterable sequence of (inputs, targets); batches are read from the memory maps when indexed."""

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch_size: int, rank: int, world_size: int,
                 count: int) -> None:
        self.stream, self.seq_len, self.micro_batch_size = stream, seq_len, micro_batch_size
        self.rank, self.world_size, self.count = rank, world_size, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not -self.count <= index < self.count:
            raise IndexError(index)
        index %= self.count
        first = (index * self.world_size + self.rank) * self.micro_batch_size
        starts = np.arange(first, first + self.micro_batch_size, dtype=np.int64) * self.seq_len
        return _to_tensors(self.stream.windows(starts, self.seq_len + 1))

    @property
    def tokens(self) -> int:
        """Target tokens on this rank."""
        return self.count * self.micro_batch_size * self.seq_len
