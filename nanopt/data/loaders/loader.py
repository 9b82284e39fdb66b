"""The resumable distributed loader used by train, eval, find-batch and profile.

A split is one token stream cut into windows of seq_len + 1 tokens with stride seq_len (inputs are a window's
first seq_len tokens, targets the last seq_len). Window w starts at token w * seq_len; the split has
(tokens - 1) // seq_len of them.

Training order: sample k of the run is window perm_e(k mod W) of epoch e = k // W, where perm_e is a seeded
Feistel permutation (O(1) memory) keyed by (seed, e), so each epoch is a fresh shuffle. A run may read more samples
than the split has windows: every epoch reads each window exactly once, and a micro-batch may straddle two epochs.
The position (step, micro-step) is all a checkpoint needs, so a run resumes exactly in the middle of any epoch.
`epochs_at(step)` is the passes over the split after a step: 1.37 is one whole pass and 37% of the next.

Sample assignment: optimizer step s consumes G = micro_batch_size x grad_accum x world_size samples, namely
[s*G, (s+1)*G); micro-step m of rank r takes the B samples starting at s*G + (m*world_size + r)*B. The samples of a
step therefore depend only on G: one rank with grad_accum 2 and two ranks with grad_accum 1 train on the same
samples, and a run may resume on another number of ranks (or micro-batch size) at a step boundary. Under batch
warmup (nanopt.config.batch_ramp) G_s and the first sample of step s (the prefix sum of G) are pure functions of s
from train.json alone, step s runs G_s / (B x world_size) micro-steps, and the same holds.

Evaluation scores a fixed slice instead, chosen by the split, seq_len and the requested tokens N alone, never by
the world size or micro-batch size: the split's first min(N, tokens - 1) targets (all: tokens - 1; the first token
has nothing before it to predict it from), in windows of seq_len from the split's start, the last one partial when
N is not a multiple of seq_len or when `all` leaves tokens after the last whole window. Only scored targets count
(padding targets are IGNORE_INDEX), so the loss is the token-weighted mean over exactly those targets on any layout.
Window-batches are dealt round-robin to the ranks; every rank runs as many forward passes (a rank short of one runs
a batch that scores nothing), because a sharded model's forward pass is itself a collective.

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

from nanopt.config.batch_ramp import BatchRamp
from nanopt.data.dataset import TokenDataset, TokenStream, check_compatible, retokenize_hint
from nanopt.data.loaders.permutation import FeistelPermutation
from nanopt.errors import DataError, ResumeError

__all__ = ["EVAL_SLICE_VERSION", "EvalBatches", "TrainLoader", "check_compatible", "check_token_ids", "eval_batches"]

STATE_VERSION = 1
CHECK_CHUNK_TOKENS = 1 << 22  # tokens range-checked per read: bounds the check's memory (32 MiB as int64)


def _windows_in(stream: TokenStream, seq_len: int) -> int:
    return max(0, (stream.total - 1) // seq_len)


def _to_tensors(windows: np.ndarray, pin_memory: bool = False) -> tuple[Any, Any]:
    import torch

    inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
    targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
    if pin_memory:  # page-locked: the copy to the GPU is one DMA that need not wait for the host
        return inputs.pin_memory(), targets.pin_memory()
    return inputs, targets


class _ReadAhead:
    """One micro-batch read in a background thread, labelled with the loader position it belongs to."""

    def __init__(self, pin_for: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pin_for = pin_for
        # The thread pins for this rank's GPU: without set_device it would make a CUDA context on GPU 0 (as torch's
        # DataLoader does in its pin-memory thread).
        initializer = _set_cuda_device if pin_for is not None else None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanopt-read-ahead",
                                           initializer=initializer, initargs=(pin_for,) if initializer else ())
        self.position: tuple[int, int] | None = None
        self.future: Any = None

    def start(self, position: tuple[int, int], read: Any) -> None:
        self.position, self.future = position, self.executor.submit(read)

    def take(self, position: tuple[int, int]) -> tuple[Any, Any] | None:
        """The batch read ahead for `position`; None when there is none, or it was read for another position (the
        loader was moved since: a resume, a rollback), which is dropped."""
        future, self.future = self.future, None
        started_for, self.position = self.position, None
        if future is None or started_for != position:
            return None
        return future.result()  # an error of the read (a vanished shard) is raised here, in the training thread

    def close(self) -> None:
        self.future = None
        self.executor.shutdown(wait=True, cancel_futures=True)


def _set_cuda_device(device: Any) -> None:
    import torch

    torch.cuda.set_device(device)


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

    batch_ramp: BatchRamp | None = None  # batch warmup (nanopt.config.batch_ramp): the batch of each step

    def __init__(self, dataset: TokenDataset, split: str, seq_len: int, micro_batch_size: int, grad_accum: int,
                 rank: int, world_size: int, seed: int, batch_ramp: BatchRamp | None = None) -> None:
        _check_layout(seq_len, micro_batch_size, rank, world_size)
        self.batch_ramp = batch_ramp
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
                            "tokenize a larger corpus" + (", or with a larger --val-fraction (on a small corpus "
                                                          "the hash may hold out no document)" if split != "train"
                                                          else "") + ", or lower seq_len")
        self.step = 0  # optimizer steps completed
        self.micro_step = 0  # micro-steps of the current step already handed out
        self._permutation: FeistelPermutation | None = None
        self._checked_step = -1  # the last step whose token ids were checked
        self._read_ahead: _ReadAhead | None = None  # see prefetch()
        self._check_step()  # the first step's now, so plainly bad data fails before any work (a profiler, a model)

    @property
    def samples_per_step(self) -> int:
        """The full global batch, in samples (under batch warmup, the batch after the ramp)."""
        return self.micro_batch_size * self.grad_accum * self.world_size

    def samples_in(self, step: int) -> int:
        """The global batch of optimizer step `step`, in samples."""
        ramp = self.batch_ramp
        return self.samples_per_step if ramp is None else ramp.tokens_in(step) // self.seq_len

    def first_sample_of(self, step: int) -> int:
        """The global index of step `step`'s first sample: the samples of every step before it."""
        ramp = self.batch_ramp
        return step * self.samples_per_step if ramp is None else ramp.tokens_before(step) // self.seq_len

    def tokens_in(self, step: int) -> int:
        """The global batch of optimizer step `step`, in tokens."""
        return self.samples_in(step) * self.seq_len

    def seek(self, step: int) -> None:
        """Move to the start of optimizer step `step` (a rollback's skip, a preflight's chosen step)."""
        self.load_state_dict({**self.state_dict(), "step": step, "micro_step": 0})

    def accum_at(self, step: int) -> int:
        """Micro-batches per rank in optimizer step `step`: grad_accum, or fewer during batch warmup."""
        return self.samples_in(step) // (self.micro_batch_size * self.world_size)

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (0 during the first pass over the split)."""
        return self._first_sample() // self.num_windows

    def epochs_at(self, step: int) -> float:
        """Passes over the split after `step` optimizer steps, counting every rank's samples: 1.37 is one whole
        pass and 37% of the next. The same on every rank and any world size (samples_per_step is the global
        batch)."""
        return self.first_sample_of(step) / self.num_windows

    def _first_sample(self) -> int:
        return (self.first_sample_of(self.step)
                + (self.micro_step * self.world_size + self.rank) * self.micro_batch_size)

    def prefetch(self, pin_for: Any = None) -> None:
        """From now on read each next micro-batch in a background thread while the current one trains (one ahead),
        into pinned memory for the CUDA device `pin_for` (a non-blocking copy to it; None: not pinned). The
        batches, their order and state_dict() stay exactly as without it: the batch read ahead is not consumed
        until next_batch hands it out, and one read for a position the loader has since left (load_state_dict) is
        dropped."""
        if self._read_ahead is None or self._read_ahead.pin_for != pin_for:
            self.close()
            self._read_ahead = _ReadAhead(pin_for)

    def close(self) -> None:
        """Stop reading ahead (the background thread ends)."""
        if self._read_ahead is not None:
            self._read_ahead.close()
            self._read_ahead = None

    def next_batch(self) -> tuple[Any, Any]:
        """(inputs, targets): int64 CPU tensors of shape [micro_batch_size, seq_len] (pinned when prefetching for a
        GPU). Reading ahead, the step's last micro-batch leaves the next read to plan_ahead()."""
        if self._checked_step != self.step:  # also after resuming in the middle of a step
            self._check_step()
        ahead = self._read_ahead
        batch = ahead.take((self.step, self.micro_step)) if ahead is not None else None
        if batch is None:
            batch = self._read(self._starts(), ahead is not None and ahead.pin_for is not None)
        self.micro_step += 1
        if self.micro_step == self.accum_at(self.step):
            self.step, self.micro_step = self.step + 1, 0
        elif ahead is not None:
            self.plan_ahead()  # the step's next micro-batch: the host is ahead of the device here
        return batch

    def plan_ahead(self) -> None:
        """Start reading the next micro-batch in the background (when prefetching and not already started), and
        check the token ids of its step if it begins one. The training step calls this between its last backward
        and its one host sync, while the device still has work queued: done in next_batch, the permutation and
        the check (about 2 ms a step at GPT-2's shape) ran after the sync, while the device waited. A check that
        fails is kept and raised by next_batch when the data reaches that step, as it would have been."""
        ahead = self._read_ahead
        if ahead is None or ahead.position == (self.step, self.micro_step):
            return
        if self._checked_step != self.step:
            try:
                self._check_step()
            except DataError:
                return  # not read ahead: next_batch checks this step again and raises
        starts, pin = self._starts(), ahead.pin_for is not None
        ahead.start((self.step, self.micro_step), lambda: self._read(starts, pin))

    def _starts(self) -> np.ndarray:
        """Token offsets of the windows of the next micro-batch."""
        first = self._first_sample()
        return self._windows(np.arange(first, first + self.micro_batch_size, dtype=np.int64)) * self.seq_len

    def _read(self, starts: np.ndarray, pin_memory: bool) -> tuple[Any, Any]:
        return _to_tensors(self.stream.windows(starts, self.seq_len + 1), pin_memory)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (or pickle) of the loader has its position and no background thread."""
        return {**self.__dict__, "_read_ahead": None}

    def _check_step(self) -> None:
        """Check the token ids of every sample of the step, on every rank: the same DataError on all ranks."""
        first = self.first_sample_of(self.step)
        starts = self._windows(np.arange(first, first + self.samples_in(self.step), dtype=np.int64)) * self.seq_len
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


# Names the rule that picks the evaluated tokens; eval.json settings record it, so a result made under another rule
# is recomputed rather than reused. 1: whole micro-batches per rank, trimmed to a multiple of the world size.
# 2: the first min(N, tokens - 1) targets whatever the layout, with a last partial window (module docstring).
EVAL_SLICE_VERSION = 2


def eval_batches(dataset: TokenDataset, split: str, seq_len: int, micro_batch_size: int, rank: int,
                 world_size: int, max_tokens: int | None) -> EvalBatches:
    """This rank's share of the evaluation slice: the split's first min(max_tokens, tokens - 1) targets (all of
    them when max_tokens is None), in seq_len windows from the split's start, the last one partial.

    The slice depends only on the split, seq_len and max_tokens; micro_batch_size and the world size only decide
    how it is dealt out (see EvalBatches), so the loss is the same on any layout up to summation order. DataError if
    the split holds not even one whole window, or the slice a token id past the vocabulary.
    """
    _check_layout(seq_len, micro_batch_size, rank, world_size)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens {max_tokens} must be positive (None: the whole split)")
    stream = dataset.stream(split)
    if _windows_in(stream, seq_len) < 1:
        raise DataError(f"{dataset.path}: split '{split}' has {stream.total:,} tokens, fewer than one window of "
                        f"seq_len + 1 = {seq_len + 1:,} to evaluate",
                        f"tokenize with a larger --{split}-tokens or a bigger corpus, or lower seq_len")
    targets = stream.total - 1 if max_tokens is None else min(max_tokens, stream.total - 1)
    # The whole slice, on every rank: a bad id in another rank's share stops this rank too.
    whole, tail = divmod(targets, seq_len)
    check_token_ids(dataset, split, stream, np.arange(whole, dtype=np.int64) * seq_len, seq_len + 1)
    if tail:
        check_token_ids(dataset, split, stream, np.array([whole * seq_len], dtype=np.int64), tail + 1)
    return EvalBatches(stream, seq_len, micro_batch_size, rank, world_size, targets)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)  # exact for any size, where math.ceil(a / b) rounds through a float


class EvalBatches(Sequence):
    """A sized, re-iterable sequence of (inputs, targets); batches are read from the memory maps when indexed.

    Window w holds targets [w * seq_len + 1, ...] of the split, at most seq_len of them; batch b holds windows
    [b * rows, (b + 1) * rows), and rank r takes batches r, r + world_size, ... Every batch is [rows, seq_len], with
    rows = min(micro_batch_size, windows), so a compiled model sees one shape and a split smaller than a micro-batch
    costs no more than its windows. Positions past a partial window and rows past the last window are padding:
    input token 0, target IGNORE_INDEX, scored by nothing. Ranks get the same number of batches, a rank short of
    one taking a batch of padding alone, because each forward pass of a sharded (FSDP) or DDP model is itself a
    collective that every rank must enter; the loss's own all-reduce comes once, after the last batch.
    """

    def __init__(self, stream: TokenStream, seq_len: int, micro_batch_size: int, rank: int, world_size: int,
                 targets: int) -> None:
        self.stream, self.seq_len, self.rank, self.world_size = stream, seq_len, rank, world_size
        self.targets = targets  # scored over all ranks together
        self.windows = _ceil_div(targets, seq_len)
        self.rows = min(micro_batch_size, self.windows)
        self.count = _ceil_div(_ceil_div(self.windows, self.rows), world_size)  # batches per rank, padding included

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        from nanopt.model.loss import IGNORE_INDEX

        if not -self.count <= index < self.count:
            raise IndexError(index)
        index %= self.count
        first = (index * self.world_size + self.rank) * self.rows
        inputs = np.zeros((self.rows, self.seq_len), dtype=np.int64)
        targets = np.full((self.rows, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        tokens = np.empty(self.seq_len + 1, dtype=np.int64)
        for row, window in enumerate(range(first, min(first + self.rows, self.windows))):
            start = window * self.seq_len
            scored = min(self.seq_len, self.targets - start)
            self.stream.read(start, tokens[:scored + 1])
            inputs[row, :scored], targets[row, :scored] = tokens[:scored], tokens[1:scored + 1]
        return torch.from_numpy(inputs), torch.from_numpy(targets)
