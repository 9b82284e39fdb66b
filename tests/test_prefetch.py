"""The training loader reads the next micro-batch ahead in a background thread (into pinned memory on a GPU host),
and nothing else changes: the same batches in the same order, and a position (state_dict) that never counts the
batch read ahead, so a checkpoint resumes at the very next batch and a rollback reads the right one."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import TrainLoader

SEQ, BATCH, ACCUM = 16, 3, 2


class ReadingThreads:
    """Wraps a dataset's token stream to note which thread read each batch's windows."""

    def __init__(self, stream) -> None:
        self.stream, self.threads = stream, []

    def windows(self, starts, length):
        if len(starts) == BATCH:  # a micro-batch; the step's token-id check reads all the step's windows at once
            self.threads.append(threading.current_thread().name)
        return self.stream.windows(starts, length)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _loader(dataset, prefetch: bool) -> TrainLoader:
    loader = TrainLoader(dataset, "train", SEQ, BATCH, ACCUM, rank=0, world_size=1, seed=3)
    if prefetch:
        loader.prefetch()
    return loader


def _take(loader: TrainLoader, count: int) -> list[torch.Tensor]:
    """As the training step does: plan_ahead() once a step's micro-batches are all handed out (before its sync)."""
    batches = []
    for _ in range(count):
        batches.append(torch.cat(loader.next_batch(), dim=1))
        if loader.micro_step == 0:
            loader.plan_ahead()
    return batches


def test_prefetching_keeps_the_order_the_position_and_the_resume(tiny_dataset: Path):
    dataset = TokenDataset.open(tiny_dataset)
    plain = _loader(dataset, prefetch=False)
    expected = _take(plain, 9)

    ahead = _loader(dataset, prefetch=True)
    ahead.stream = ReadingThreads(ahead.stream)
    got = _take(ahead, 5)  # mid-step: 5 micro-batches of accumulation 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected[:5], strict=True))
    # Every batch after the first was read in the background, before it was asked for: within a step because
    # next_batch started it, across steps because plan_ahead did.
    assert ahead.stream.threads[0] == threading.current_thread().name
    assert all(name != threading.current_thread().name for name in ahead.stream.threads[1:]), ahead.stream.threads
    ahead._read_ahead.future.result()  # the sixth read runs in the background: let it finish before counting
    assert len(ahead.stream.threads) == 6  # the five handed out, and the sixth read ahead

    # The position is that of the batches handed out, not of the one read ahead.
    state = ahead.state_dict()
    assert (state["step"], state["micro_step"]) == (2, 1)
    resumed = _loader(dataset, prefetch=True)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_take(resumed, 4), expected[5:9], strict=True))

    # A rollback to an earlier position discards the batch read ahead and reads the one it asks for.
    earlier = _loader(dataset, prefetch=False)
    _take(earlier, 2)
    ahead.load_state_dict(earlier.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_take(ahead, 3), expected[2:5], strict=True))
    ahead.close()
    resumed.close()


def test_the_training_step_reads_the_next_steps_batch_before_its_sync(tmp_path: Path, tiny_dataset: Path):
    """Reading ahead (a GPU host's loader, here without pinning), the first micro-batch of every step after the
    first was read in the background: the step planned it (plan_ahead) before its host sync, not after."""
    from trainhelp import make_run

    from nanopt.config import load_run
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session
    from nanopt.train.step import step

    run = make_run(tmp_path, tiny_dataset, micro_batch_size=BATCH, global_batch_tokens=BATCH * 32 * ACCUM)
    session = build_session(load_run(run), init_runtime("fp32"))
    session.loader.prefetch()
    session.loader.stream = ReadingThreads(session.loader.stream)
    for _ in range(3):
        step(session)
    session.loader.close()
    threads = session.loader.stream.threads
    assert len(threads) >= 3 * ACCUM and threads[0] == threading.current_thread().name
    assert all(name != threading.current_thread().name for name in threads[1:3 * ACCUM]), threads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_reads_batches_into_pinned_memory_on_a_gpu_host(tmp_path: Path, tiny_dataset: Path):
    # Through build_session, which every command that steps (train, find-batch, profile, preflight) uses.
    from trainhelp import make_run

    from nanopt.config import load_run
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session

    session = build_session(load_run(make_run(tmp_path, tiny_dataset)), init_runtime("fp32"))
    for _ in range(3):
        inputs, targets = session.loader.next_batch()
        assert inputs.is_pinned() and targets.is_pinned()
    session.loader.close()
