"""The training loader of a run with sequence-length stages (nanopt.config.seq_stages): one TrainLoader per stage,
the one of the stage the current step is in handing out its micro-batches.

Stage i's loader cuts the split into windows of its own length L_i and reads them in its own shuffled order (the
Feistel permutation of its window count, keyed by the seed and the epoch, nanopt.data.loaders.loader). Every step trains
global_batch_tokens, so a step of stage i is G / L_i of its samples, and step s begins at its sample
s x G / L_i: the stage starts where the tokens trained before it put it in its own order, and its epochs are
counted in tokens (1.5 passes over the split are 1.5 passes whatever the lengths were). Sample k of a stage is
window perm(k mod W_i) of its epoch k // W_i, so within a stage each window is read once per epoch, and a step's
samples depend on the step alone: the same on any world size or micro-batch, as TrainLoader's.

Its state is the current stage's loader state (which names that stage's seq_len): a checkpoint resumes in the
stage of its step, on any number of ranks, and one whose step moved into another stage (a budget changed on
resume) is refused by the stage loader's seq_len check rather than read at the wrong length.
"""

from __future__ import annotations

from typing import Any

from nanopt.config.seq_stages import SeqStage, stage_at
from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import TrainLoader


class StagedLoader:
    """TrainLoader's interface over the stages' loaders (see the module docstring)."""

    batch_ramp = None  # stages are refused together with batch warmup (nanopt.config.seq_stages.check_alone)

    def __init__(self, dataset: TokenDataset, split: str, stages: tuple[SeqStage, ...], grad_accum: int, rank: int,
                 world_size: int, seed: int) -> None:
        self.stages = stages
        # Every stage's loader now: a split without one window of a later stage's length fails at start-up, not
        # hours into the run.
        self.loaders = [TrainLoader(dataset, split, stage.seq_len, stage.micro_batch_size, grad_accum, rank,
                                    world_size, seed) for stage in stages]
        self._active = 0

    # ------------------------------------------------------------------ which stage

    def _index_at(self, step: int) -> int:
        return self.stages.index(stage_at(self.stages, step))

    def loader_at(self, step: int) -> TrainLoader:
        """The loader of the stage optimizer step `step` trains in."""
        return self.loaders[self._index_at(step)]

    @property
    def current(self) -> TrainLoader:
        return self.loaders[self._active]

    # ------------------------------------------------------------------ TrainLoader's interface

    @property
    def step(self) -> int:
        return self.current.step

    @property
    def micro_step(self) -> int:
        return self.current.micro_step

    @property
    def seq_len(self) -> int:
        """The current stage's sequence length."""
        return self.current.seq_len

    @property
    def micro_batch_size(self) -> int:
        return self.current.micro_batch_size

    @property
    def samples_per_step(self) -> int:
        return self.current.samples_per_step

    @property
    def num_windows(self) -> int:
        """The base stage's windows: train.json's seq_len, the one the run reports its data in."""
        return self.loaders[0].num_windows

    @property
    def epoch(self) -> int:
        return self.current.epoch

    def samples_in(self, step: int) -> int:
        return self.loader_at(step).samples_in(step)

    def tokens_in(self, step: int) -> int:
        return self.loader_at(step).tokens_in(step)

    def accum_at(self, step: int) -> int:
        return self.loader_at(step).accum_at(step)

    def first_sample_of(self, step: int) -> int:
        """The sequences (of any stage's length) the steps before `step` read: a count, as a rollback reports it."""
        count = 0
        for index, stage in enumerate(self.stages):
            if stage.first_step >= step:
                break
            end = self.stages[index + 1].first_step if index + 1 < len(self.stages) else step
            count += (min(end, step) - stage.first_step) * self.loaders[index].samples_per_step
        return count

    def epochs_at(self, step: int) -> float:
        """Passes over the split after `step` steps, counted in tokens (module docstring)."""
        return self.loader_at(step).epochs_at(step)

    def next_batch(self) -> tuple[Any, Any]:
        batch = self.current.next_batch()
        if self._index_at(self.current.step) != self._active:  # the stage's last step is done: the next begins
            self.seek(self.current.step)
        return batch

    def plan_ahead(self) -> None:
        """The next micro-batch's read, in the stage it belongs to (next_batch has already moved there)."""
        self.current.plan_ahead()

    def seek(self, step: int) -> None:
        """Move to the start of optimizer step `step`, in its stage."""
        index = self._index_at(step)
        self.loaders[index].seek(step)
        self._active = index

    def prefetch(self, pin_for: Any = None) -> None:
        for loader in self.loaders:
            loader.prefetch(pin_for)

    def close(self) -> None:
        for loader in self.loaders:
            loader.close()

    def state_dict(self) -> dict[str, Any]:
        """The current stage's loader state: its seq_len says which stage it is."""
        return self.current.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        index = self._index_at(step) if isinstance(step, int) and step >= 0 else 0  # malformed: the loader says so
        self.loaders[index].load_state_dict(state)
        self._active = index
