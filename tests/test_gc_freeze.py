"""After the first (warm-up) step, training freezes the heap it has built (model, optimizer, compiled code), so
Python's full collections no longer walk it: no multi-100 ms pauses while the GPU waits for the next launch. The
heap is unfrozen when the loop ends, so a process that trains again can free the old session."""

from __future__ import annotations

import gc
from pathlib import Path

from faulthelp import tiny_run

from nanopt.config import load_run
from nanopt.train.loop import train
from nanopt.train.observe.events import Silent
from nanopt.train.session import TrainOptions


class FrozenAtEachLog(Silent):
    def __init__(self) -> None:
        self.frozen: dict[int, int] = {}

    def log(self, record: dict, total_steps: int) -> None:
        self.frozen[record["step"]] = gc.get_freeze_count()


def test_the_heap_is_frozen_after_the_first_step_and_unfrozen_after_the_loop(tmp_path: Path, tiny_dataset: Path):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=3, eval_interval=0, checkpoint_interval=0)
    gc.unfreeze()
    observer = FrozenAtEachLog()
    summary = train(load_run(run), TrainOptions(resume="none"), observer)
    assert summary["steps"] == 3
    assert set(observer.frozen) == {1, 2, 3}
    # The model, optimizer and torch's own objects: far more than a handful.
    assert all(count > 10_000 for count in observer.frozen.values()), observer.frozen
    assert gc.get_freeze_count() == 0
