"""What `nanopt tokenize` says about the held-out splits of outside data: a split that is mostly one document, the
median document of a corpus of long documents, and an option that would leave val empty."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error
from conftest import english_like_documents, write_jsonl

from nanopt.data.corpus.sources import TextListSource
from nanopt.data.tokenize.documents import MAX_PIECE_CHARS, split_of
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.data.tokenizers.tokenizer import load_tokenizer

SHARE = 0.05  # the default share of documents held out for val, and as many for test


def held_out_as(split: str, body: str) -> str:
    """`body` with a prefix that makes its hash hold it out for `split`."""
    return next(text for seed in range(1000) if split_of((text := f"{seed} {body}").encode(), SHARE, SHARE) == split)


def only(split: str, texts: list[str]) -> list[str]:
    return [t for t in texts if split_of(t.encode(), SHARE, SHARE) == split]


@pytest.fixture(scope="module")
def man_page() -> str:
    """One long document (like bash(1)): encoded in pieces, and past 2**17 tokens with a 300-token BPE."""
    body = " ".join(english_like_documents(1200, seed=8, max_sentences=8))
    assert len(body) > MAX_PIECE_CHARS
    return held_out_as("val", body)


def token_count(dataset: Path, text: str) -> int:
    return len(load_tokenizer(str(dataset)).tokenizer.encode(text, add_special_tokens=False).ids)


def test_a_val_split_of_one_long_document_is_warned_about_and_its_median_is_exact(tmp_path: Path, man_page: str):
    others = [t for t in english_like_documents(60, seed=4) if split_of(t.encode(), SHARE, SHARE) != "val"]
    summary = build_dataset(tmp_path / "ds", TextListSource([*others[:30], man_page, *others[30:]]), vocab_size=300)
    val = summary["splits"]["val"]
    length = token_count(tmp_path / "ds", man_page)
    assert val["documents"] == 1 and length > 1 << 17  # in the power-of-two bucket [2**17, 2**18)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())["splits"]["val"]
    assert meta["median_document_tokens"] == meta["longest_document_tokens"] == length  # not 196,608
    [warning] = [w for w in summary["warnings"] if w.startswith("val is")]
    assert f"val is one document of {length:,} tokens: every evaluation on val measures that one text" in warning
    assert "raise --val-fraction (e.g. 0.2) and --val-tokens" in warning


def test_a_split_mostly_one_document_is_warned_about(tmp_path: Path, man_page: str):
    others = english_like_documents(80, seed=5)
    assert len(only("val", others)) >= 2 and only("test", others)
    summary = build_dataset(tmp_path / "ds", TextListSource([*others, man_page]), vocab_size=300)
    val = summary["splits"]["val"]
    length = token_count(tmp_path / "ds", man_page)
    share = (length + 1) / val["tokens"]
    assert val["documents"] == len(only("val", others)) + 1 and share > 0.5
    [warning] = [w for w in summary["warnings"] if w.startswith("val is")]
    assert (f"val is mostly one document ({length:,} of its {val['tokens']:,} tokens, {share:.0%}, in "
            f"{val['documents']} documents): evaluation on val mostly measures that one text") in warning
    assert not any(w.startswith("test is") for w in summary["warnings"])  # test: many short documents


def test_a_median_among_long_documents_is_exact(tmp_path: Path):
    body = " ".join(english_like_documents(400, seed=2, max_sentences=8))
    texts = [held_out_as("val", f"{n} {body[:size]}") for n, size in enumerate((110_000, 130_000, 150_000))]
    others = [t for t in english_like_documents(10, seed=3) if split_of(t.encode(), SHARE, SHARE) != "val"]
    summary = build_dataset(tmp_path / "ds", TextListSource(texts + others), vocab_size=300, val_fraction=SHARE,
                            test_fraction=SHARE)
    lengths = sorted(token_count(tmp_path / "ds", t) for t in texts)
    assert min(lengths) >= 1 << 16 and summary["splits"]["val"]["documents"] == 3
    assert summary["splits"]["val"]["median_document_tokens"] == lengths[1]


def test_val_fraction_zero_is_refused_before_anything_is_written(tmp_path: Path, cli_in_process):
    jsonl = write_jsonl(tmp_path / "mine.jsonl", english_like_documents(20))
    for option in ("--val-fraction", "--test-fraction"):
        result = cli_in_process("tokenize", jsonl, "--vocab-size", "300", option, "0", "--out", tmp_path / "out")
        assert_user_error(result, f"{option} 0 holds out no documents", "e.g. 0.05")
        assert not (tmp_path / "out").exists()


def test_the_note_on_a_short_val_says_what_it_took(tmp_path: Path):
    """With a small --max-tokens, reading goes on past train's budget to fill val and test: val then holds far more
    than 5% of the dataset's documents, though only 5% of those read. The note says which."""
    corpus = english_like_documents(240, seed=21)
    summary = build_dataset(tmp_path / "ds", TextListSource(corpus), vocab_size=300, max_tokens=20_000)
    val, read, total = summary["splits"]["val"], summary["documents_read"], summary["documents"]
    assert summary["stopped_at_budget"] and read == len(corpus) and val["documents"] == len(only("val", corpus))
    assert val["documents"] / total > 2 * SHARE  # the newcomer's 42 of 244
    [note] = [n for n in summary["notes"] if n.startswith("val")]
    assert note == (f"val has {val['tokens']:,} tokens in {val['documents']} documents, short of its 1,048,576-token "
                    f"target: the source ran out. The hash held out {val['documents'] / read:.1%} of the {read} "
                    f"documents read for val (--val-fraction 0.05); train stopped at --max-tokens, so val is "
                    f"{val['documents'] / total:.0%} of this dataset's {total} documents; evaluation scores all of it")
