"""Training for more than one pass over the train split: each epoch a fresh order of every window, the epoch in
metrics.jsonl and on the console, one warning when a run will repeat data, and an exact resume mid-epoch.

The runs train on a real dataset of a dozen short documents (a few dozen windows of 16 tokens, in several shards), so
the 40 steps of 4 sequences of tests/faulthelp.py's tiny run read it two to three times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import english_like_documents, write_jsonl
from faulthelp import HANG_GUARD_S, TINY_TRAIN, Child, Launcher, tiny_run
from trainhelp import final_weights_hash, losses

from nanopt.cli.display import format as fmt
from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import TrainLoader
from nanopt.train import checkpoint as ckpt

SEQ_LEN = 16  # faulthelp.TINY_MODEL's max_position_embeddings
SAMPLES_PER_STEP = TINY_TRAIN["global_batch_tokens"] // SEQ_LEN
SETTINGS = {"checkpoint_interval": 4, "eval_interval": 0}  # 40 steps (TINY_TRAIN)


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dataset whose train split is a few hundred tokens, in shards of at most 300 tokens."""
    from nanopt.data.tokenize.pipeline import build_dataset

    root = tmp_path_factory.mktemp("small")
    corpus = write_jsonl(root / "few.jsonl", english_like_documents(12, seed=3, max_sentences=8))
    build_dataset(root / "data", str(corpus), vocab_size=512, val_fraction=0.25, test_fraction=0.1,
                  shard_tokens=300)
    return root / "data"


def windows_in(dataset: Path) -> int:
    """Training windows of SEQ_LEN + 1 tokens at stride SEQ_LEN in the train split (nanopt.data.loaders.loader)."""
    return (TokenDataset.open(dataset).split_tokens("train") - 1) // SEQ_LEN


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    """Each sequence of a micro-batch as the window of tokens it was cut from."""
    inputs, targets = batch
    return [tuple(i) + (int(t[-1]),) for i, t in zip(inputs.tolist(), targets.tolist(), strict=True)]


# ------------------------------------------------------------------------------------------- the loader


def test_every_epoch_reads_each_window_once_in_a_fresh_order_on_every_rank_layout(small_dataset: Path):
    ds = TokenDataset.open(small_dataset)
    count, world = windows_in(small_dataset), 2
    micro = next(size for size in range(2, count) if count % size)  # so some micro-batch straddles two epochs
    ranks = [TrainLoader(ds, "train", SEQ_LEN, micro, 1, rank, world, seed=7) for rank in range(world)]
    assert ranks[0].num_windows == count
    stream = ds.stream("train")
    every = sorted(tuple(window) for window in stream.windows(np.arange(count) * SEQ_LEN, SEQ_LEN + 1).tolist())
    read: list[tuple[int, ...]] = []  # in the run's sample order: step by step, rank 0's micro-batch, then rank 1's
    steps = 3 * count // (micro * world) + 1
    for step in range(1, steps + 1):
        for loader in ranks:
            read += rows(loader.next_batch())
        for loader in ranks:  # passes over the split so far, the same on every rank
            assert loader.epochs_at(step) == step * micro * world / count
    passes = [read[e * count:(e + 1) * count] for e in range(3)]
    for one_pass in passes:
        assert sorted(one_pass) == every  # each window exactly once per epoch
    assert passes[0] != passes[1] != passes[2] != passes[0]  # a fresh order every epoch
    assert ranks[0].epochs_at(steps) > 3


# -------------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, small_dataset: Path, launcher: Launcher) -> Child:
    """`nanopt train RUN --json` of 40 steps, about three passes over the split, uninterrupted. No evaluation: no
    loss chart to draw, so it is faster; every loss and the final weights are compared."""
    run = tiny_run(tmp_path_factory.mktemp("straight"), small_dataset, "run", **SETTINGS)
    child = launcher.train(run, "--json")
    child.run = run
    return child


def test_a_run_longer_than_its_train_split_trains_warns_once_and_logs_the_epoch(straight: Child,
                                                                                small_dataset: Path):
    count, steps = windows_in(small_dataset), TINY_TRAIN["max_steps"]
    split_tokens = TokenDataset.open(small_dataset).split_tokens("train")
    epochs = steps * SAMPLES_PER_STEP / count
    assert epochs > 2

    # One warning before the first step, with the split's size, what the run reads and the epochs that makes.
    warnings = [line for line in straight.stderr.splitlines() if "data repeats" in line]
    assert len(warnings) == 1, straight.stderr
    for fragment in (f"reads {fmt.count(steps * TINY_TRAIN['global_batch_tokens'])} tokens",
                     f"train split of {fmt.count(split_tokens)} tokens ({count} sequences of {SEQ_LEN})",
                     f"{epochs:.2f} epochs"):
        assert fragment in warnings[0], (fragment, warnings[0])
    assert straight.stderr.index("data repeats") < straight.stderr.index("step 1/")
    # Recorded for a later reader too: an event before the first step, with the same numbers.
    logged = records(straight.run)
    repeats = [{k: v for k, v in r.items() if k != "time"} for r in logged if r.get("event") == "data_repeats"]
    assert repeats == [{"kind": "event", "step": 0, "event": "data_repeats", "split_tokens": split_tokens,
                        "split_sequences": count, "seq_len": SEQ_LEN,
                        "run_tokens": steps * TINY_TRAIN["global_batch_tokens"], "epochs": epochs}]

    # Every train record carries the passes over the split so far; the log line shows it once data repeats.
    train = {r["step"]: r for r in logged if r["kind"] == "train"}
    assert sorted(train) == list(range(1, steps + 1))
    lines = {int(line.split()[1].split("/")[0]): line for line in straight.stderr.splitlines()
             if line.startswith("step ") and "loss" in line}
    for step, record in train.items():
        assert record["epoch"] == pytest.approx(step * SAMPLES_PER_STEP / count)
        shown = f"epoch {record['epoch']:.2f}"
        assert (shown in lines[step]) == (record["epoch"] > 1), lines[step]
    assert json.loads(straight.stdout)["epochs"] == pytest.approx(epochs)


def test_a_run_within_one_epoch_does_not_warn_until_its_budget_is_raised_past_it(tmp_path: Path,
                                                                                 small_dataset: Path,
                                                                                 cli_in_process):
    count = windows_in(small_dataset)
    fits = count // SAMPLES_PER_STEP  # whole steps within the first pass
    run = tiny_run(tmp_path, small_dataset, "run", max_steps=fits, eval_interval=0, checkpoint_interval=fits)
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr
    assert "data repeats" not in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("step ") and "epoch" in line]
    assert not [r for r in records(run) if r.get("event") == "data_repeats"]
    assert max(r["epoch"] for r in records(run) if r["kind"] == "train") <= 1

    # Trained further (the newcomer's "more steps, please"): now it repeats data, and says so once, at the resume.
    longer = 2 * fits  # past one pass: fits is the most that stays within it
    result = cli_in_process("train", run, "--no-live", "--set", f"max_steps={longer}", "--allow-changed")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("data repeats") == 1
    assert f"{longer * SAMPLES_PER_STEP / count:.2f} epochs" in result.stderr
    assert [(r["step"], r["epochs"]) for r in records(run) if r.get("event") == "data_repeats"] == [
        (fits, longer * SAMPLES_PER_STEP / count)]


def test_killed_in_its_second_epoch_then_resumed_equals_an_uninterrupted_run(tmp_path: Path, small_dataset: Path,
                                                                               straight: Child, launcher: Launcher):
    count = windows_in(small_dataset)
    killed = tiny_run(tmp_path, small_dataset, "killed", **SETTINGS)

    # SIGKILL as soon as a checkpoint inside the second epoch is complete.
    child = launcher.start("train", killed, "--no-live")
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and not launcher.finished(child):
        latest = ckpt.read_pointer(killed / "checkpoints", "latest")
        if latest and int(latest.split("-")[1]) * SAMPLES_PER_STEP > count:
            os.kill(child.pid, signal.SIGKILL)
            break
        time.sleep(0.001)
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed in its second epoch"

    resumed = launcher.train(killed)
    step = int(re.search(r"resumed from \S+ \(step (\d+),", resumed.stderr).group(1))
    assert count < step * SAMPLES_PER_STEP < TINY_TRAIN["max_steps"] * SAMPLES_PER_STEP  # mid-run, past one pass
    assert (step * SAMPLES_PER_STEP) % count  # and in the middle of an epoch
    assert losses(killed) == losses(straight.run)
    assert final_weights_hash(killed) == final_weights_hash(straight.run)
    epochs = {r["step"]: r["epoch"] for r in records(killed) if r["kind"] == "train"}
    assert epochs == {r["step"]: r["epoch"] for r in records(straight.run) if r["kind"] == "train"}
    # The warning came once, when the run started, not again on resuming.
    assert "data repeats" not in resumed.stderr
    assert [r["step"] for r in records(killed) if r.get("event") == "data_repeats"] == [0]
