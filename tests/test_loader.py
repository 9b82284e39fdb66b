"""The dataset reader and the distributed loader: windows, shuffling, rank layout, resume, eval slices, checks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_SETTINGS

from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import TrainLoader, check_compatible, eval_batches
from nanopt.data.loaders.permutation import FeistelPermutation
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.errors import DataError, ResumeError


def full_stream(ds: TokenDataset, split: str) -> np.ndarray:
    return np.concatenate([np.asarray(a) for a in ds.stream(split).arrays]).astype(np.int64)


def rows(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, ...]]:
    inputs, targets = batch
    return [tuple(i) + (int(t[-1]),) for i, t in zip(inputs.tolist(), targets.tolist(), strict=True)]


def loader(ds: TokenDataset, seq_len: int = 32, micro: int = 4, accum: int = 1, rank: int = 0, world: int = 1,
           seed: int = 7) -> TrainLoader:
    return TrainLoader(ds, "train", seq_len, micro, accum, rank, world, seed)


@pytest.fixture(scope="module")
def ds(tiny_dataset: Path) -> TokenDataset:
    return TokenDataset.open(tiny_dataset)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_feistel_permutation_is_a_bijection_that_depends_on_seed_and_epoch(n: int):
    values = FeistelPermutation(n, seed=3)(np.arange(n))
    assert sorted(values.tolist()) == list(range(n))
    assert np.array_equal(values, FeistelPermutation(n, seed=3)(np.arange(n)))
    if n >= 64:
        assert not np.array_equal(values, FeistelPermutation(n, seed=4)(np.arange(n)))
        assert not np.array_equal(values, FeistelPermutation(n, seed=3, epoch=1)(np.arange(n)))
        assert not np.array_equal(values, np.arange(n))


def test_batches_are_shifted_windows_of_the_stream(ds: TokenDataset):
    stream, seq_len = full_stream(ds, "train"), 32
    inputs, targets = loader(ds, seq_len=seq_len, micro=8).next_batch()
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (8, seq_len)
    assert inputs.is_contiguous() and targets.is_contiguous()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row_in, row_target in zip(inputs.numpy(), targets.numpy(), strict=True):
        starts = np.flatnonzero(np.all(
            np.lib.stride_tricks.sliding_window_view(stream, seq_len)[::seq_len] == row_in, axis=1))
        assert starts.size >= 1  # the row is a window starting at a multiple of seq_len
        assert np.array_equal(stream[starts[0] * seq_len + 1:starts[0] * seq_len + 1 + seq_len], row_target)


def test_one_epoch_visits_every_window_once_then_reshuffles(ds: TokenDataset):
    seq_len, micro = 1024, 4
    train = loader(ds, seq_len=seq_len, micro=micro)
    windows = train.num_windows
    assert windows == (ds.split_tokens("train") - 1) // seq_len
    stream = full_stream(ds, "train")
    every = sorted(tuple(stream[w * seq_len:w * seq_len + seq_len + 1].tolist()) for w in range(windows))
    epoch_rows: list[tuple[int, ...]] = []
    while len(epoch_rows) < 2 * windows + micro:  # crosses two epoch boundaries, inside micro-batches
        epoch_rows += rows(train.next_batch())
    assert sorted(epoch_rows[:windows]) == every
    assert sorted(epoch_rows[windows:2 * windows]) == every
    assert epoch_rows[:windows] != epoch_rows[windows:2 * windows]  # a fresh order each epoch
    assert train.epoch == 2


def test_ranks_at_a_global_step_are_disjoint_and_together_the_single_rank_batches(ds: TokenDataset):
    single = loader(ds, micro=4, accum=4)
    pairs = [loader(ds, micro=4, accum=2, rank=r, world=2) for r in range(2)]
    quads = [loader(ds, micro=2, accum=2, rank=r, world=4) for r in range(4)]
    for _ in range(3):  # global steps
        reference = [rows(single.next_batch()) for _ in range(4)]
        pair_batches = [[rows(ld.next_batch()) for _ in range(2)] for ld in pairs]
        for rank in range(2):
            for micro in range(2):  # micro-step m of rank r holds samples s*G + (m*world + r)*B ...
                assert pair_batches[rank][micro] == reference[micro * 2 + rank]
        flat = [row for ld in quads for _ in range(ld.grad_accum) for row in rows(ld.next_batch())]
        assert len(set(flat)) == len(flat) == 16  # disjoint across ranks and micro-steps
        assert sorted(flat) == sorted(row for batch in reference for row in batch)


def test_restored_loader_continues_exactly_like_an_uninterrupted_one(ds: TokenDataset):
    straight, interrupted = loader(ds, seq_len=512, micro=3, accum=3), loader(ds, seq_len=512, micro=3, accum=3)
    for _ in range(50):  # mid-epoch and mid-step (50 is not a multiple of 3)
        interrupted.next_batch()
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = loader(ds, seq_len=512, micro=3, accum=3)
    resumed.load_state_dict(state)
    expected = [rows(straight.next_batch()) for _ in range(130)][50:]  # runs past the end of an epoch
    assert [rows(resumed.next_batch()) for _ in range(80)] == expected


def test_resume_on_another_world_size_at_a_step_boundary(ds: TokenDataset):
    one = loader(ds, micro=4, accum=2)
    for _ in range(6):  # three optimizer steps
        one.next_batch()
    state = one.state_dict()
    ranks = [loader(ds, micro=2, accum=2, rank=r, world=2) for r in range(2)]
    for ld in ranks:
        ld.load_state_dict(state)
    expected = rows(one.next_batch()) + rows(one.next_batch())
    got = [row for ld in ranks for _ in range(2) for row in rows(ld.next_batch())]
    assert sorted(got) == sorted(expected)


def test_resume_refuses_a_different_loader(ds: TokenDataset):
    saved = loader(ds, micro=4, accum=2)
    saved.next_batch()  # mid-step
    state = saved.state_dict()
    for other, fragment in ((loader(ds, seed=8, micro=4, accum=2), "seed"),
                            (loader(ds, seq_len=64, micro=4, accum=2), "seq_len"),
                            (loader(ds, micro=4, accum=4), "samples_per_step"),
                            (loader(ds, micro=2, accum=2, world=2), "middle of an optimizer step")):
        with pytest.raises(ResumeError, match=fragment):
            other.load_state_dict(state)
    with pytest.raises(ResumeError, match="malformed"):
        loader(ds).load_state_dict({"step": 3})


def test_eval_batches_are_a_fixed_slice_dealt_out_to_ranks_with_equal_counts(ds: TokenDataset):
    seq_len, micro = 32, 4
    stream = full_stream(ds, "val")
    single = eval_batches(ds, "val", seq_len, micro, 0, 1, max_tokens=24 * seq_len)
    assert len(single) == 6 and single.targets == 24 * seq_len
    first_windows = [tuple(stream[w * seq_len:w * seq_len + seq_len + 1].tolist()) for w in range(24)]
    assert [row for batch in single for row in rows(batch)] == first_windows  # the first windows, in order
    assert [rows(b) for b in single] == [rows(b) for b in single]  # re-iterable, the same every time
    for world in (2, 3, 5):  # 6 batches: 3 each on 2 ranks, 2 each on 3, and on 5 one rank runs a batch of padding
        shares = [eval_batches(ds, "val", seq_len, micro, r, world, max_tokens=24 * seq_len) for r in range(world)]
        assert len({len(s) for s in shares}) == 1  # every rank runs the same number of batches
        flat = [row for share in shares for batch in share for row in rows(batch) if -100 not in row]
        assert sorted(flat) == sorted(first_windows)  # together exactly the single rank's windows
    capped = eval_batches(ds, "val", seq_len, micro, 0, 1, max_tokens=10**9)
    assert capped.targets == ds.split_tokens("val") - 1  # as much as exists, no more
    assert len(capped) == math.ceil(math.ceil(capped.targets / seq_len) / micro)  # the last batch partly padding
    assert eval_batches(ds, "val", seq_len, micro, 0, 1, max_tokens=1).targets == 1


def test_too_few_tokens_are_data_errors_that_say_how_many(ds: TokenDataset):
    tokens = ds.split_tokens("val")
    with pytest.raises(DataError, match=f"{tokens:,} tokens") as info:
        eval_batches(ds, "val", 100_000, 8, 0, 2, max_tokens=65536)
    assert "fewer than one window of seq_len + 1 = 100,001" in info.value.message and info.value.hint
    train_tokens = ds.split_tokens("train")  # one window of seq_len + 1 is enough to train (for many epochs)
    assert TrainLoader(ds, "train", train_tokens - 1, 1, 1, 0, 1, 0).num_windows == 1
    with pytest.raises(DataError, match=f"has {train_tokens:,} tokens, fewer than one training sequence"):
        TrainLoader(ds, "train", train_tokens, 1, 1, 0, 1, 0)
    with pytest.raises(DataError, match="fewer than one training sequence"):
        TrainLoader(ds, "test", 100_000, 1, 1, 0, 1, 0)
    with pytest.raises(DataError, match="no split 'holdout'"):
        ds.split_tokens("holdout")


def test_vocab_compatibility(ds: TokenDataset):
    check_compatible(ds, 512)
    check_compatible(ds, 576)  # a padded model vocabulary is fine
    with pytest.raises(DataError, match="512 token ids but the model's vocab_size is 500") as info:
        check_compatible(ds, 500)
    assert "vocab_size to at least 512" in info.value.hint


def test_bytes_per_token_matches_the_recorded_text(ds: TokenDataset):
    for split in ("train", "val", "test"):
        info = ds.meta["splits"][split]
        assert ds.bytes_per_token(split) == pytest.approx(info["bytes"] / info["tokens"])
        assert 2.0 < ds.bytes_per_token(split) < 8.0


def test_windows_cross_many_small_shards(tiny_dataset: Path, tiny_corpus: Path, tmp_path: Path):
    settings = {**TINY_SETTINGS, "shard_tokens": 997}
    del settings["vocab_size"]
    build_dataset(tmp_path / "small", str(tiny_corpus), tokenizer=str(tiny_dataset / "tokenizer.json"), **settings)
    small, big = TokenDataset.open(tmp_path / "small"), TokenDataset.open(tiny_dataset)
    assert len(small.stream("train").arrays) > 100
    assert np.array_equal(full_stream(small, "train"), full_stream(big, "train"))
    a, b = loader(small, seq_len=2048, micro=4, seed=1), loader(big, seq_len=2048, micro=4, seed=1)
    for _ in range(5):  # 2049-token windows span three 997-token shards
        assert rows(a.next_batch()) == rows(b.next_batch())


# ------------------------------------------------------------------------------------- damaged datasets


@pytest.fixture
def copy(tiny_dataset: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(tiny_dataset, target)
    return target


def _edit_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def test_missing_or_incomplete_dataset_directories(tmp_path: Path, copy: Path):
    with pytest.raises(DataError, match="dataset directory not found") as info:
        TokenDataset.open(tmp_path / "nothing")
    assert "nanopt tokenize" in info.value.hint
    (copy / "meta.json").unlink()
    with pytest.raises(DataError, match="incomplete dataset"):
        TokenDataset.open(copy)


def test_shard_with_the_wrong_dtype_is_refused(copy: Path):
    shard = copy / "train" / "shard-00000.npy"
    np.save(shard, np.load(shard).astype(np.uint32))
    with pytest.raises(DataError, match="tokens are uint32 but meta.json says uint16"):
        TokenDataset.open(copy)


def test_truncated_missing_and_garbled_shards_are_refused(copy: Path):
    shard = copy / "val" / "shard-00000.npy"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(DataError, match="truncated"):
        TokenDataset.open(copy)
    shard.write_bytes(b"\0" * 128 + data[128:])  # what an interrupted writer leaves: no header yet
    with pytest.raises(DataError, match="not a valid .npy shard"):
        TokenDataset.open(copy)
    shard.unlink()
    with pytest.raises(DataError, match="shard file not found"):
        TokenDataset.open(copy)


def test_checksum_mismatch_is_found_by_verify(copy: Path):
    shard = copy / "test" / "shard-00000.npy"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    dataset = TokenDataset.open(copy, verify_up_to_bytes=0)  # headers and sizes still agree
    with pytest.raises(DataError, match="checksum mismatch"):
        dataset.verify()
    with pytest.raises(DataError, match="checksum mismatch"):
        TokenDataset.open(copy)  # a dataset this small is hashed whole at open


@pytest.mark.parametrize("changes, fragment", [
    ({"format_version": 99}, "newer than this nanopt reads"),
    ({"format": "something-else"}, "not a nanopt dataset"),
    ({"dtype": "float32"}, "key 'dtype'"),
    ({"vocab_size": 70_000}, "cannot hold a vocabulary"),
    ({"eos_id": 512}, "outside vocab_size"),
    ({"splits": {"val": {}}}, "without a train split"),
])
def test_inconsistent_meta_is_refused(copy: Path, changes: dict, fragment: str):
    _edit_meta(copy, **changes)
    with pytest.raises(DataError, match=fragment):
        TokenDataset.open(copy)


def test_meta_that_is_not_json_and_a_missing_tokenizer(copy: Path):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(DataError, match="tokenizer.json is missing"):
        TokenDataset.open(copy)
    (copy / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="meta.json: malformed JSON"):
        TokenDataset.open(copy)
