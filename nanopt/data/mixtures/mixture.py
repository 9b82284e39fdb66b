"""A data mixture: several dataset directories, one tokenizer, read at the weights of train.json's phases.

`open_run_data` opens what train.json's `data` names: one TokenDataset, or a MixtureData of every source, after
checking that they share one tokenizer (tokenizer.json's sha256), before any step. `MixtureLoader` is the
TrainLoader over a mixture: global sample k comes from the source nanopt.data.mixtures.interleave places there (a pure
function of k and the phases), and is that source's window perm_e(m mod W) of its epoch e = m // W, where m is how
many samples the source gave before k and perm_e a Feistel permutation keyed by (seed, source name, e). So a source
that runs out starts its next epoch on its own, with a new order, and the position (step, micro-step) is all a
checkpoint needs: the samples of a step, their split across ranks, resuming on another world size and the token-id
check are exactly the single-dataset loader's (nanopt.data.loaders.loader).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nanopt.config.mixture import Mixture
from nanopt.data.dataset import VERIFY_AT_OPEN_BYTES, TokenDataset, open_run_dataset
from nanopt.data.loaders.loader import (  # with the single-dataset loader's own steps
    CHECK_CHUNK_TOKENS,
    EvalBatches,
    TrainLoader,
    _check_layout,
    _to_tensors,
    _windows_in,
    check_token_ids,
    eval_batches,
)
from nanopt.data.loaders.permutation import FeistelPermutation
from nanopt.data.mixtures.interleave import Interleave
from nanopt.errors import DataError, ResumeError

if TYPE_CHECKING:
    from nanopt.config import RunConfig


class MixtureData:
    """The sources of a mixture, in train.json's order. It answers for the whole as a TokenDataset does where a
    run needs one dataset's facts (the tokenizer, the end-of-text id, the id limit, a fingerprint of the data)."""

    def __init__(self, mixture: Mixture, datasets: list[TokenDataset]) -> None:
        self.mixture, self.datasets = mixture, datasets
        self.names = mixture.names
        first = datasets[0]
        self.path, self.vocab_size, self.eos_id = first.path, first.vocab_size, first.eos_id
        self.tokenizer_path, self.tokenizer_sha256 = first.tokenizer_path, first.tokenizer_sha256
        # What nanopt.train.checkpoint.resume.data_fingerprint hashes: every source's shards, under its name.
        named = zip(self.names, datasets, strict=True)
        self.meta = {"splits": {name: dataset.meta["splits"] for name, dataset in named}}

    @property
    def id_limit(self) -> int:
        return max(dataset.id_limit for dataset in self.datasets)

    def tokenizer(self) -> Any:
        return self.datasets[0].tokenizer()

    def dataset_of(self, name: str) -> TokenDataset:
        return self.datasets[self.names.index(name)]

    def split_tokens(self, split: str) -> int:
        return sum(dataset.split_tokens(split) for dataset in self.datasets)


def open_run_data(run: RunConfig, *, verify_up_to_bytes: int = VERIFY_AT_OPEN_BYTES) -> TokenDataset | MixtureData:
    """train.json's `data`: one dataset, or every source of a mixture, checked to share the first's tokenizer."""
    mixture = run.mixture
    if mixture is None:
        return open_run_dataset(run, verify_up_to_bytes=verify_up_to_bytes)
    datasets = [open_run_dataset(run, verify_up_to_bytes=verify_up_to_bytes, path=path, given=item.path)
                for item, path in zip(mixture.sources, run.data_dirs, strict=True)]
    first = datasets[0]
    for dataset in datasets[1:]:
        if dataset.tokenizer_sha256 != first.tokenizer_sha256:
            raise DataError(f"{dataset.path}: tokenized with another tokenizer than {first.path} (tokenizer.json "
                            f"sha256 {dataset.tokenizer_sha256[:12]} and {first.tokenizer_sha256[:12]}); the "
                            "sources of a mixture share one",
                            f"re-tokenize it with `nanopt tokenize SOURCE --tokenizer {first.path} --out "
                            f"{dataset.path} --force`")
    return MixtureData(mixture, datasets)


def _source_seed(seed: int, name: str) -> int:
    """Each source's permutations are keyed by the run's seed and the source's name."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1


class MixtureLoader(TrainLoader):
    """TrainLoader's batches, position and checks over a mixture's train splits (see the module docstring)."""

    def __init__(self, data: MixtureData, split: str, seq_len: int, micro_batch_size: int, grad_accum: int,
                 rank: int, world_size: int, seed: int) -> None:
        _check_layout(seq_len, micro_batch_size, rank, world_size)
        if grad_accum < 1:
            raise ValueError(f"grad_accum {grad_accum} must be positive")
        self.data, self.dataset, self.split, self.seq_len, self.seed = data, data, split, seq_len, seed
        self.micro_batch_size, self.grad_accum, self.rank, self.world_size = (micro_batch_size, grad_accum, rank,
                                                                              world_size)
        self.streams = [dataset.stream(split) for dataset in data.datasets]
        self.source_windows = np.array([_windows_in(stream, seq_len) for stream in self.streams], dtype=np.int64)
        for dataset, stream, windows in zip(data.datasets, self.streams, self.source_windows, strict=True):
            if windows < 1:
                raise DataError(f"{dataset.path}: split '{split}' has {stream.total:,} tokens, fewer than one "
                                f"training sequence of seq_len + 1 = {seq_len + 1:,}",
                                "tokenize a larger corpus, lower seq_len, or leave the source out of the mixture")
        self.num_windows = int(self.source_windows.sum())
        phases = data.mixture.phases
        self.interleave = Interleave([phase.start_step * self.samples_per_step for phase in phases],
                                     [phase.weights for phase in phases])
        self._seeds = [_source_seed(seed, name) for name in data.names]
        self._permutations: dict[int, tuple[int, FeistelPermutation]] = {}  # source: (epoch, its permutation)
        self.step, self.micro_step, self._checked_step, self._read_ahead = 0, 0, -1, None
        self._located: tuple[int, np.ndarray, np.ndarray] | None = None  # (step, sources, starts) of its samples
        self._limits = np.array([dataset.id_limit for dataset in data.datasets], dtype=np.int64)
        self._check_step()

    # ------------------------------------------------------------------ accounting

    def samples_by_source(self, step: int) -> np.ndarray:
        """Samples each source gave to the first `step` optimizer steps (all ranks)."""
        return self.interleave.given_before(step * self.samples_per_step)

    def source_epochs_at(self, step: int) -> np.ndarray:
        """Passes over each source's train split after `step` optimizer steps: 2.5 is two whole passes and half."""
        return self.samples_by_source(step) / self.source_windows

    def epochs_at(self, step: int) -> float:
        """The most repeated source's passes (the run's `epoch` figure; source_epochs_at has each)."""
        return float(self.source_epochs_at(step).max())

    @property
    def epoch(self) -> int:
        return int(self.epochs_at(self.step))

    def accounting(self, step: int) -> dict[str, dict[str, float]]:
        """Tokens and epochs of each source after `step` steps: metrics.jsonl's `sources`."""
        samples, epochs = self.samples_by_source(step), self.source_epochs_at(step)
        return {name: {"tokens": int(samples[i]) * self.seq_len, "epochs": float(epochs[i])}
                for i, name in enumerate(self.data.names)}

    # ------------------------------------------------------------------ reading

    def _starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, token offset in its split) of each sample of the next micro-batch."""
        sources, starts = self._step_samples()
        offset = self._first_sample() - self.step * self.samples_per_step
        return sources[offset:offset + self.micro_batch_size], starts[offset:offset + self.micro_batch_size]

    def _step_samples(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, token offset) of every sample of the current step, all ranks', found once per step: the
        lookups are a few small NumPy operations each, which per micro-batch would cost more than the reads."""
        if self._located is None or self._located[0] != self.step:
            first = self.step * self.samples_per_step
            self._located = (self.step, *self._locate(np.arange(first, first + self.samples_per_step,
                                                                dtype=np.int64)))
        return self._located[1], self._located[2]

    def _locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sources, indices = self.interleave.locate(samples)
        windows = np.empty_like(indices)
        for source in np.unique(sources):
            chosen = sources == source
            epochs, positions = np.divmod(indices[chosen], self.source_windows[source])
            found = np.empty_like(positions)
            for epoch in np.unique(epochs):  # a micro-batch may straddle two epochs of a source
                picked = epochs == epoch
                found[picked] = self._source_permutation(int(source), int(epoch))(positions[picked])
            windows[chosen] = found
        return sources, windows * self.seq_len

    def _source_permutation(self, source: int, epoch: int) -> FeistelPermutation:
        cached = self._permutations.get(source)
        if cached is None or cached[0] != epoch:
            cached = (epoch, FeistelPermutation(int(self.source_windows[source]), self._seeds[source], epoch))
            self._permutations[source] = cached
        return cached[1]

    def _read(self, located: tuple[np.ndarray, np.ndarray], pin_memory: bool) -> tuple[Any, Any]:
        return _to_tensors(self._windows_of(*located), pin_memory)

    def _windows_of(self, sources: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Rows of seq_len + 1 tokens, row i from source sources[i] at starts[i] (a row at a time, as
        TokenStream.windows reads one stream)."""
        windows = np.empty((len(starts), self.seq_len + 1), dtype=np.int64)
        for row, (source, start) in enumerate(zip(sources.tolist(), starts.tolist(), strict=True)):
            self.streams[source].read(start, windows[row])
        return windows

    def _check_step(self) -> None:
        """Every sample of the step, on every rank, against its source's id limit: the same DataError on all.
        The step's windows are read once; a source with an id past its limit is read again by check_token_ids,
        which names the shard and the offset."""
        sources, starts = self._step_samples()
        rows = max(1, CHECK_CHUNK_TOKENS // (self.seq_len + 1))
        for first in range(0, len(starts), rows):
            chosen = slice(first, first + rows)
            bad = self._windows_of(sources[chosen], starts[chosen]).max(axis=1) >= self._limits[sources[chosen]]
            for source in np.unique(sources[chosen][bad]):
                check_token_ids(self.data.datasets[int(source)], self.split, self.streams[int(source)],
                                starts[chosen][sources[chosen] == source], self.seq_len + 1,
                                f" at step {self.step + 1}")
        self._checked_step = self.step

    # ------------------------------------------------------------------ position

    def _mixture_state(self) -> dict[str, Any]:
        sizes = zip(self.data.names, self.source_windows, strict=True)
        return {"sources": [[name, int(windows)] for name, windows in sizes],
                "phases": [[phase.start_step, list(phase.weights)] for phase in self.data.mixture.phases]}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mixture": self._mixture_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As TrainLoader's, and the mixture must be the one that chose the samples read so far: the same sources
        (names and sizes) and the same phases up to the checkpoint's step (later ones may change)."""
        saved, now = state.get("mixture") if isinstance(state, dict) else None, self._mixture_state()
        if not isinstance(saved, dict) or saved.get("sources") != now["sources"]:
            raise ResumeError(f"data loader: the mixture's sources were {_shown(saved, 'sources')} in the checkpoint "
                              f"and are {_shown(now, 'sources')} now",
                              "point train.json's data at the checkpoint's datasets, or start a new run directory")
        super().load_state_dict(state)
        if _phases_up_to(saved.get("phases"), self.step) != _phases_up_to(now["phases"], self.step):
            raise ResumeError(f"data loader: the mixture's phases up to step {self.step} changed since the "
                              f"checkpoint (were {_shown(saved, 'phases')}, are {_shown(now, 'phases')})",
                              "restore data_phases (a phase that has not started yet may change), or start a new "
                              "run directory")


def _phases_up_to(phases: Any, step: int) -> Any:
    """The phases that chose samples of the first `step` steps: those that start before it."""
    if not isinstance(phases, list):
        return phases
    return [phase for phase in phases if isinstance(phase, list) and phase and isinstance(phase[0], int)
            and phase[0] < step]


def _shown(state: Any, key: str) -> str:
    from nanopt.parsing import show_value

    return show_value(state.get(key) if isinstance(state, dict) else None, 120)


class MixtureEvalBatches(Sequence):
    """The evaluation slices of every source, one after another: `parts` names each source's EvalBatches. Every
    rank gets as many batches of each part (EvalBatches deals them so), so scoring part by part, with one
    all-reduce per part, keeps the ranks in step; scored whole, the loss is the token-weighted mean over sources."""

    def __init__(self, parts: list[tuple[str, EvalBatches]]) -> None:
        self.parts = parts
        self._ends = np.cumsum([len(batches) for _, batches in parts])

    def __len__(self) -> int:
        return int(self._ends[-1])

    @property
    def targets(self) -> int:
        """Targets scored over all ranks and sources."""
        return sum(batches.targets for _, batches in self.parts)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        part = int(np.searchsorted(self._ends, index, side="right"))
        return self.parts[part][1][index - (int(self._ends[part - 1]) if part else 0)]


def run_eval_batches(data: TokenDataset | MixtureData, split: str, seq_len: int, micro_batch_size: int, rank: int,
                     world_size: int, max_tokens: int | None) -> EvalBatches | MixtureEvalBatches:
    """eval_batches over one dataset, or over each source of a mixture: each its own split, max_tokens shared by
    `data`'s weights (at least one window each; None: every source's whole split)."""
    if not isinstance(data, MixtureData):
        return eval_batches(data, split, seq_len, micro_batch_size, rank, world_size, max_tokens)
    parts = []
    for name, dataset, weight in zip(data.names, data.datasets, data.mixture.phases[0].weights, strict=True):
        tokens = None if max_tokens is None else max(seq_len, round(max_tokens * weight))
        parts.append((name, eval_batches(dataset, split, seq_len, micro_batch_size, rank, world_size, tokens)))
    return MixtureEvalBatches(parts)
