"""`nanopt tokenize --shuffle-buffer N --shuffle-seed S`: a source sorted by origin gives splits (and a training
order) that mix the origins; the buffer never holds more than N documents; the same seed gives the same shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
from clihelp import assert_user_error, run_cli
from conftest import english_like_documents

from nanopt.data.corpus.sources import TextListSource
from nanopt.data.dataset import TokenDataset
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.data.tokenize.shuffle import shuffled


def test_buffer_holds_at_most_n_documents_and_emits_a_seeded_permutation():
    held = []
    read = 0

    def counting(n):
        nonlocal read
        for i in range(n):
            read += 1
            yield str(i)

    out = []
    for text in shuffled(counting(1000), 50, seed=3):
        held.append(read - len(out))  # read but not yet emitted, as this one is handed out
        out.append(text)
    assert max(held) <= 51 and sorted(out, key=int) == [str(i) for i in range(1000)]
    assert out != [str(i) for i in range(1000)]
    # a document moves earlier by at most the buffer size
    assert all(int(text) <= position + 50 for position, text in enumerate(out))
    assert list(shuffled(map(str, range(1000)), 50, seed=3)) == out
    assert list(shuffled(map(str, range(1000)), 50, seed=4)) != out


# 1000 documents from one origin, then 1000 from another: val and test (2000 tokens, ~25 documents each) fill up
# long before the second origin begins.
SORTED = ([f"alpha {text}" for text in english_like_documents(1000, seed=1, max_sentences=6)]
          + [f"omega {text}" for text in english_like_documents(1000, seed=2, max_sentences=6)])
SETTINGS = dict(vocab_size=512, val_tokens=2000, test_tokens=2000, shard_tokens=1_000_000)


def origins(dataset_dir, split: str) -> list[str]:
    """The first word of each document of a split, in order ("alpha" or "omega")."""
    dataset = TokenDataset.open(dataset_dir)
    tokens = np.concatenate(dataset.stream(split).arrays)
    ends = np.flatnonzero(tokens == dataset.eos_id)
    starts = np.concatenate(([0], ends[:-1] + 1))
    tokenizer = dataset.tokenizer()
    return [tokenizer.decode(tokens[s:s + 3].tolist()).split()[0] for s in starts]


def test_a_sorted_source_gives_mixed_splits_only_when_shuffled(tmp_path):
    build_dataset(tmp_path / "sorted", TextListSource(SORTED), **SETTINGS)
    for split in ("val", "test"):  # held out in source order: all from the first origin
        assert set(origins(tmp_path / "sorted", split)) == {"alpha"}
    build_dataset(tmp_path / "shuffled", TextListSource(SORTED), shuffle_buffer=2000, shuffle_seed=0, **SETTINGS)
    for split in ("val", "test", "train"):  # seed 0 draws 15 / 24 and 9 / 23 omega documents for val and test
        found = origins(tmp_path / "shuffled", split)
        share = found.count("omega") / len(found)
        assert 0.2 < share < 0.8, (split, share, len(found))
    train = origins(tmp_path / "shuffled", "train")
    assert train[:100].count("omega") > 25  # the training order mixes from the start


def test_the_same_seed_gives_the_same_shards_and_meta_records_it(tmp_path):
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        build_dataset(tmp_path / name, TextListSource(SORTED[:400]), shuffle_buffer=100, shuffle_seed=seed,
                      **SETTINGS)
    meta = {name: json.loads((tmp_path / name / "meta.json").read_text()) for name in "abc"}
    assert meta["a"]["splits"] == meta["b"]["splits"] and meta["a"]["splits"] != meta["c"]["splits"]
    assert (meta["a"]["settings"]["shuffle_buffer"], meta["a"]["settings"]["shuffle_seed"]) == (100, 5)


@pytest.mark.parametrize(("args", "named"), [
    (["--shuffle-seed", "3"], "--shuffle-seed without --shuffle-buffer"),
    (["--shuffle-buffer", "0"], "--shuffle-buffer"),
    (["--shuffle-buffer", "10", "--shuffle-seed", "-1"], "--shuffle-seed"),
])
def test_bad_shuffle_options_are_one_line_errors(tmp_path, args, named):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n")
    result = run_cli("tokenize", corpus, "--vocab-size", "300", "--out", tmp_path / "out", *args)
    assert_user_error(result, named)
    assert not (tmp_path / "out").exists()
