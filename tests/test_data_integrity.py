"""Data integrity at open, for every command: a dataset damaged after `nanopt tokenize` wrote it is refused before
any work, with one line that names the damaged file, exit status 2, no traceback, and nothing written.

The damage is done with real file writes on a copy of the shared `tiny_dataset` (never the fixture itself): a shard
rewritten in place with the same size, a truncated shard, token ids past the vocabulary written into a split
through a memory map (the .npy header stays), and garbage in tokenizer.json. Some cases also recompute meta.json's
checksums, so that the bytes and their checksums agree: that is what the cheap checks at open see of a dataset too
large to hash there, or of one a faulty tokenizer wrote, and only the loader's range check can then catch the ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run, tree_digest

from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import TrainLoader, eval_batches
from nanopt.errors import DataError
from nanopt.rundir import RunDir

BAD_ID = 60_000  # fits the uint16 shards, far past the vocabulary of 512


# ---------------------------------------------------------------------------------------------------- damage


def copy_dataset(tiny_dataset: Path, root: Path, name: str = "data") -> Path:
    return Path(shutil.copytree(tiny_dataset, root / name))


def shard_file(dataset: Path, split: str, index: int = 0) -> Path:
    return dataset / split / f"shard-{index:05d}.npy"


def rewrite_tokens(path: Path, change: Callable[[np.ndarray], None]) -> None:
    """Change a shard's tokens in place through a memory map: header, dtype, length and file size stay the same."""
    size = path.stat().st_size
    tokens = np.load(path, mmap_mode="r+")
    change(tokens)
    tokens.flush()
    del tokens
    assert path.stat().st_size == size


def write_bad_ids(tokens: np.ndarray) -> None:
    tokens[::5] = BAD_ID


def shuffle_valid_ids(tokens: np.ndarray) -> None:
    """Other bytes, every id still inside the vocabulary: only a checksum can tell."""
    tokens[:] = np.roll(np.asarray(tokens).copy(), 7)


def refresh_checksums(dataset: Path) -> None:
    """meta.json's sha256 of every shard and of tokenizer.json recomputed from the files as they are now."""
    meta = json.loads((dataset / "meta.json").read_text())
    for info in meta["splits"].values():
        for shard in info["shards"]:
            shard["sha256"] = hashlib.sha256((dataset / shard["file"]).read_bytes()).hexdigest()
    meta["tokenizer"]["sha256"] = hashlib.sha256((dataset / "tokenizer.json").read_bytes()).hexdigest()
    (dataset / "meta.json").write_text(json.dumps(meta))


def snapshot(*paths: Path) -> dict[str, dict[str, str]]:
    """Every file under each path with its hash. A run's lock file is left out: `nanopt train` takes the lock before
    it opens the dataset, and that file (naming the last holder) is the lock itself, not output."""
    lock = RunDir(Path("run")).lock.name
    return {str(p): {name: digest for name, digest in tree_digest(p).items() if Path(name).name != lock}
            for p in paths}


# -------------------------------------------------------------------------------------------------- commands


def trained_on(data: Path, root: Path, launcher: Launcher) -> Path:
    """A 4-step run on `data` with one checkpoint, step-000004."""
    run = tiny_run(root, data, "trained", max_steps=4, checkpoint_interval=4, eval_interval=0)
    launcher.train(run)
    return run


@dataclass
class Command:
    argv: list[object]
    watch: list[Path]  # every path the command could write into: it must write nothing
    forked: bool = False  # `nanopt train` runs in a process of its own, as a user starts it


def command_on(name: str, data: Path, root: Path, launcher: Launcher) -> Command:
    """`nanopt NAME` on the dataset `data`, set up while `data` is intact: eval and export use a run trained on it."""
    if name in ("train", "profile"):
        run = tiny_run(root, data, "fresh")
        if name == "train":
            return Command(["train", run, "--no-live"], [run, data], forked=True)
        return Command(["profile", run, "--steps", "1", "--wait", "0", "--warmup", "0", "--no-tensorboard"],
                       [run, data])
    run = trained_on(data, root, launcher)
    if name == "eval":  # with samples, which need the tokenizer
        return Command(["eval", run, "--tokens", "1024", "--max-new-tokens", "4"], [run, data])
    out = root / "exported"  # --data: the checkpoint carries its tokenizer, so export opens a dataset only when told
    return Command(["export", run, "--data", data, "--out", out], [run, data, out])


def run_refused(command: Command, launcher: Launcher, cli_in_process) -> SimpleNamespace:
    """Run the command; return its result after checking that it wrote nothing."""
    before = snapshot(*command.watch)
    if command.forked:
        child = launcher.run(*command.argv)
        result = SimpleNamespace(returncode=child.status, stderr=child.stderr)
    else:
        result = cli_in_process(*command.argv)
    assert snapshot(*command.watch) == before, result.stderr[-3000:]
    return result


def damaged_train_shard(data: Path) -> tuple[str, ...]:
    rewrite_tokens(shard_file(data, "train", 1), shuffle_valid_ids)
    return "train/shard-00001.npy", "checksum mismatch"


def truncated_test_shard(data: Path) -> tuple[str, ...]:
    path = shard_file(data, "test")
    path.write_bytes(path.read_bytes()[:-10])
    return "test/shard-00000.npy", "truncated"


def bad_ids_in_val(data: Path) -> tuple[str, ...]:
    rewrite_tokens(shard_file(data, "val"), write_bad_ids)
    return "val/shard-00000.npy", "checksum mismatch"


def garbage_tokenizer(data: Path) -> tuple[str, ...]:
    (data / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": [oops')
    return "tokenizer.json", "checksum mismatch"


# Damage whose checksum no longer matches: every command that opens the dataset refuses it.
CHECKSUM_CASES = [damaged_train_shard, truncated_test_shard, bad_ids_in_val, garbage_tokenizer]


@pytest.mark.parametrize("command", ["train", "eval", "export"])
@pytest.mark.parametrize("damage", CHECKSUM_CASES, ids=[c.__name__ for c in CHECKSUM_CASES])
def test_a_damaged_dataset_is_refused_at_open_by_every_command(damage, command: str, tiny_dataset: Path,
                                                               tmp_path: Path, launcher: Launcher, cli_in_process):
    data = copy_dataset(tiny_dataset, tmp_path)
    job = command_on(command, data, tmp_path, launcher)
    damaged_file, *fragments = damage(data)
    result = run_refused(job, launcher, cli_in_process)
    assert_user_error(result, str(data / damaged_file), *fragments)


# Damage that agrees with its checksums: found by the loader's range check, before any work starts.
@pytest.mark.parametrize("command, split", [("train", "val"), ("eval", "test"), ("train", "train"),
                                            ("profile", "train")])
def test_token_ids_past_the_vocabulary_are_refused(command: str, split: str, tiny_dataset: Path, tmp_path: Path,
                                                   launcher: Launcher, cli_in_process):
    data = copy_dataset(tiny_dataset, tmp_path)
    job = command_on(command, data, tmp_path, launcher)
    rewrite_tokens(shard_file(data, split), write_bad_ids)
    refresh_checksums(data)
    result = run_refused(job, launcher, cli_in_process)
    assert_user_error(result, str(shard_file(data, split)), f"split '{split}'",
                      f"token id {BAD_ID:,}", "vocabulary of 512")


# A tokenizer.json that agrees with its checksum but cannot be read: found when the dataset is opened for a
# command that needs the tokenizer, before the evaluation or export runs.
@pytest.mark.parametrize("command", ["eval", "export"])
def test_an_unreadable_tokenizer_is_refused_before_any_work(command: str, tiny_dataset: Path, tmp_path: Path,
                                                            launcher: Launcher, cli_in_process):
    data = copy_dataset(tiny_dataset, tmp_path)
    job = command_on(command, data, tmp_path, launcher)
    garbage_tokenizer(data)
    refresh_checksums(data)
    result = run_refused(job, launcher, cli_in_process)
    assert_user_error(result, str(data / "tokenizer.json"), "not a Hugging Face tokenizers file")


# ------------------------------------------------------------------------------------------------- the library


def test_full_verification_reports_progress_and_runs_at_open_only_below_its_limit(tiny_dataset: Path,
                                                                                  tmp_path: Path):
    data = copy_dataset(tiny_dataset, tmp_path)
    progress: list[tuple[int, int]] = []
    TokenDataset.open(data).verify(progress=lambda done, total: progress.append((done, total)))
    total = sum(p.stat().st_size for p in data.glob("*/shard-*.npy")) + (data / "tokenizer.json").stat().st_size
    assert progress[-1] == (total, total)
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)

    rewrite_tokens(shard_file(data, "test"), shuffle_valid_ids)
    with pytest.raises(DataError, match="test/shard-00000.npy: checksum mismatch"):
        TokenDataset.open(data)  # a dataset this small is hashed whole at open
    dataset = TokenDataset.open(data, verify_up_to_bytes=0)  # above the limit only sizes and headers are checked
    with pytest.raises(DataError, match="test/shard-00000.npy: checksum mismatch"):
        dataset.verify()


def stream_position_of(dataset: TokenDataset, split: str, window: np.ndarray) -> int:
    """Where a window a loader handed out starts in the split's token stream (found by its content)."""
    tokens = np.concatenate([np.asarray(a) for a in dataset.stream(split).arrays]).astype(np.int64)
    matches = np.flatnonzero((np.lib.stride_tricks.sliding_window_view(tokens, len(window)) == window).all(axis=1))
    assert len(matches) == 1
    return int(matches[0])


def write_bad_id_at(data: Path, split: str, position: int) -> Path:
    """BAD_ID at a position of the split's token stream, in whichever shard holds it; returns that shard."""
    shards = json.loads((data / "meta.json").read_text())["splits"][split]["shards"]
    starts = np.cumsum([0] + [shard["tokens"] for shard in shards])
    index = int(np.searchsorted(starts, position, side="right")) - 1
    offset = position - int(starts[index])

    def change(tokens: np.ndarray) -> None:
        tokens[offset] = BAD_ID

    rewrite_tokens(data / shards[index]["file"], change)
    return data / shards[index]["file"]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_every_rank_refuses_the_training_step_that_reads_a_bad_id(read_ahead: bool, tiny_dataset: Path,
                                                                 tmp_path: Path):
    """The id is in a sample only rank 1 reads, at step 3: both ranks raise there, so neither waits alone for the
    other at the step's gradient all-reduce. Reading ahead, plan_ahead() at the end of step 2 (as the training
    step calls it) checks step 3 early but leaves the error to step 3's next_batch."""
    data = copy_dataset(tiny_dataset, tmp_path)

    def loaders() -> list[TrainLoader]:
        dataset = TokenDataset.open(data, verify_up_to_bytes=0)
        return [TrainLoader(dataset, "train", 32, 2, 1, rank, 2, seed=7) for rank in (0, 1)]

    probe = loaders()
    for _ in range(2):
        for loader in probe:
            loader.next_batch()
    inputs, targets = probe[1].next_batch()
    window = np.concatenate([inputs[0].numpy(), targets[0, -1:].numpy()])
    damaged = write_bad_id_at(data, "train", stream_position_of(probe[1].dataset, "train", window) + 5)

    fresh = loaders()
    for _ in range(2):
        for loader in fresh:
            if read_ahead:
                loader.prefetch()
            loader.next_batch()
            loader.plan_ahead()
    for loader in fresh:
        with pytest.raises(DataError) as info:
            loader.next_batch()
        message = info.value.message
        assert str(damaged) in message and "split 'train'" in message and "at step 3" in message
        assert f"token id {BAD_ID:,}" in message and "vocabulary of 512" in message


def test_evaluation_batches_check_the_whole_slice_every_rank_reads(tiny_dataset: Path, tmp_path: Path):
    data = copy_dataset(tiny_dataset, tmp_path)
    # 2 ranks x 2 sequences x 32 tokens, 1024 tokens: windows 0..31, so tokens [0, 1025); window 31 is rank 1's.
    write_bad_id_at(data, "val", 32 * 32 + 5)  # past the slice: never read, so not refused
    dataset = TokenDataset.open(data, verify_up_to_bytes=0)
    assert len(eval_batches(dataset, "val", 32, 2, 0, 2, 1024)) == 8
    write_bad_id_at(data, "val", 31 * 32 + 10)
    dataset = TokenDataset.open(data, verify_up_to_bytes=0)
    with pytest.raises(DataError, match=f"split 'val' holds token id {BAD_ID:,}"):
        eval_batches(dataset, "val", 32, 2, 0, 2, 1024)


# ------------------------------------------------------------------------------------------- the tokenizer


def test_checkpoints_record_the_tokenizer_they_were_trained_with(tiny_dataset: Path, tmp_path: Path,
                                                                 launcher: Launcher):
    data = copy_dataset(tiny_dataset, tmp_path)
    meta = json.loads((trained_on(data, tmp_path, launcher) / "checkpoints" / "step-000004" / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == hashlib.sha256((data / "tokenizer.json").read_bytes()).hexdigest()


def test_eval_refuses_another_tokenizer_even_without_the_training_dataset(tiny_dataset: Path, tiny_corpus: Path,
                                                                          tmp_path: Path, launcher: Launcher,
                                                                          cli_in_process):
    from nanopt.data.tokenize.pipeline import build_dataset

    data = copy_dataset(tiny_dataset, tmp_path)
    run = trained_on(data, tmp_path, launcher)
    # Same vocabulary size, trained on less text: the ids mean other strings, which only the hash can tell.
    other = tmp_path / "other"
    build_dataset(other, str(tiny_corpus), vocab_size=512, val_fraction=0.2, test_fraction=0.2,
                  tokenizer_sample_bytes=20_000)
    shutil.rmtree(data)  # the training dataset is gone: the checkpoint still knows its tokenizer
    result = run_refused(Command(["eval", run, "--data", other, "--no-samples"], [run, other]), launcher,
                         cli_in_process)
    assert_user_error(result, "another tokenizer", "tokenizer.json sha256")
    shutil.copytree(other, data)  # the run's own dataset path, re-made with another tokenizer
    result = run_refused(Command(["eval", run, "--no-samples"], [run, data]), launcher, cli_in_process)
    assert_user_error(result, "another tokenizer", "tokenizer.json sha256")
