"""`nanopt tokenize` on a newcomer's own corpus and tokenizer: what a first run on one's own data met.

- A `--max-tokens` the corpus cannot fill says how much train got and how often a run to that budget repeats it.
- val and test are filled by tokens (the run's eval_tokens, or 1,048,576), taking at most 5% of a small corpus
  each, also with a small `--max-tokens`; the summary says when a split holds not one evaluation window.
- The end-of-text token of well-known tokenizer families is found (the document separator, never a chat
  end-of-turn token), and a nanopt dataset directory given as `--tokenizer` lends its tokenizer and EOS token.
- A malformed .jsonl is one line on stderr: nanopt's error, not a log line of the `datasets` library first.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from clihelp import assert_user_error
from conftest import english_like_documents, write_jsonl
from faulthelp import TINY_MODEL

from nanopt.data.budget import resolve_max_tokens
from nanopt.data.corpus.sources import TextListSource
from nanopt.data.dataset import TokenDataset
from nanopt.data.tokenize.documents import split_of
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.data.tokenizers.tokenizer import load_tokenizer
from nanopt.errors import DataError

SHARE = 0.05  # the default share of documents held out for val, and as many for test


def train_bpe_file(folder: Path, specials: list[str], config_eos: str | None = None) -> Path:
    """A real byte-level BPE (tokenizers library) with these special tokens, saved as folder/tokenizer.json, and
    a transformers tokenizer_config.json naming `config_eos` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300 + len(specials), special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(english_like_documents(30, seed=3), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    if config_eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": config_eos, "bos_token": None}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_file(tmp_path_factory.mktemp("gpt2-style"), ["<|endoftext|>"])


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return english_like_documents(240, seed=21)


def documents_of(dataset: Path, split: str) -> list[str]:
    """Each document of a split, decoded, in order (documents end with the EOS id)."""
    ds = TokenDataset.open(dataset)
    arrays = [np.asarray(a) for a in ds.stream(split).arrays]
    stream = np.concatenate(arrays).tolist() if arrays else []
    tokenizer = load_tokenizer(str(dataset)).tokenizer
    documents, start = [], 0
    for position, token in enumerate(stream):
        if token == ds.eos_id:
            documents.append(tokenizer.decode(stream[start:position]))
            start = position + 1
    return documents


def held_out_oracle(texts: list[str], tokenizer: Path, targets: dict[str, int | None]) -> dict[str, list[str]]:
    """The documents each split should hold: a document whose hash holds it out joins its split while that split
    has fewer tokens (EOS included) than its target, in source order; a copy goes where its first copy went."""
    encoder = load_tokenizer(str(tokenizer)).tokenizer
    splits: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    tokens = {"val": 0, "test": 0}
    for text in texts:
        split = split_of(text.encode(), SHARE, SHARE)
        if split != "train" and text not in splits[split]:
            target = targets[split]
            if target is not None and tokens[split] >= target:
                split = "train"
        if split != "train":
            tokens[split] += len(encoder.encode(text, add_special_tokens=False).ids) + 1
        splits[split].append(text)
    return splits


def write_run(root: Path, **train: object) -> Path:
    """A run directory (model.json, train.json) whose dataset is yet to be made."""
    root.mkdir(parents=True)
    (root / "model.json").write_text(json.dumps({**TINY_MODEL, "architecture": "llama", "vocab_size": 320}))
    (root / "train.json").write_text(json.dumps({"data": "../data", "micro_batch_size": 4, "global_batch_tokens": 64,
                                                 "max_steps": 10, **train}))
    return root


# ------------------------------------------------------------------------------------- 1b. a budget not filled


def test_a_max_tokens_the_corpus_cannot_fill_says_how_much_train_got(tmp_path: Path, gpt2_style: Path,
                                                                     corpus: list[str], cli_in_process):
    jsonl = write_jsonl(tmp_path / "mine.jsonl", corpus[:60])
    run = write_run(tmp_path / "run")
    asked = resolve_max_tokens("chinchilla", run)
    result = cli_in_process("tokenize", jsonl, "--tokenizer", gpt2_style, "--max-tokens", "chinchilla", "--run", run,
                            "--out", tmp_path / "data", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    got = summary["splits"]["train"]["tokens"]
    assert 0 < got < asked  # the corpus is smaller than the budget: not an error
    assert summary["budget"] == {"max_tokens": asked, "as_given": "chinchilla", "train_tokens": got,
                                 "reached": False, "share": round(got / asked, 6),
                                 "repeats": round(asked / got, 3)}
    [warning] = [w for w in summary["warnings"] if w.startswith("train has")]
    assert f"train has {got:,} tokens, {got / asked:.1%} of the {asked:,} asked for (--max-tokens chinchilla)" \
        in warning and f"a run to that budget repeats the data {asked / got:.1f} times" in warning

    shown = cli_in_process("tokenize", jsonl, "--tokenizer", gpt2_style, "--max-tokens", "5M",
                           "--out", tmp_path / "data2")
    assert shown.returncode == 0, shown.stderr
    assert f"warning: train has {got:,} tokens, {got / 5e6:.1%} of the 5,000,000 asked for (--max-tokens 5M)" \
        in " ".join(shown.stdout.split())


# ------------------------------------------------------------------------------------- 4. splits by tokens


def test_by_default_val_and_test_each_take_a_share_of_a_small_corpus(tmp_path: Path, corpus: list[str]):
    summary = build_dataset(tmp_path / "ds", TextListSource(corpus), vocab_size=300)
    expected = {split: [t for t in corpus if split_of(t.encode(), SHARE, SHARE) == split]
                for split in ("train", "val", "test")}
    assert len(expected["val"]) >= 5 and len(expected["test"]) >= 5  # the old 0.5% held out about one of each
    for split, texts in expected.items():
        assert documents_of(tmp_path / "ds", split) == texts
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["settings"]["val_tokens"] == meta["settings"]["test_tokens"] == 1_048_576
    assert meta["tokenizer"]["trained_on"]["documents"] == len(expected["train"])  # the BPE never saw val or test
    assert summary["splits"]["train"]["tokens"] > 0.85 * summary["tokens"]
    val_tokens = summary["splits"]["val"]["tokens"]
    shown = f"val has {val_tokens:,} tokens in {len(expected['val'])} documents, short of its 1,048,576-token target"
    assert any(shown in note
               and "evaluation scores all of it" in note for note in summary["notes"])


def test_targets_fill_in_source_order_and_a_copy_follows_its_first(tmp_path: Path, gpt2_style: Path,
                                                                   corpus: list[str]):
    targets = {"val": 3_000, "test": 2_000}
    first = held_out_oracle(corpus, gpt2_style, targets)
    late_candidate = first["train"][[split_of(t.encode(), SHARE, SHARE) for t in first["train"]].index("val")]
    texts = [*corpus, first["val"][0], late_candidate, first["test"][0]]  # copies after the targets are met
    expected = held_out_oracle(texts, gpt2_style, targets)
    assert expected["val"][-1] == first["val"][0] and expected["train"][-1] == late_candidate
    summary = build_dataset(tmp_path / "ds", TextListSource(texts), tokenizer=str(gpt2_style), val_tokens=3_000,
                            test_tokens=2_000)
    for split in ("train", "val", "test"):
        assert documents_of(tmp_path / "ds", split) == expected[split]
    assert 3_000 <= summary["splits"]["val"]["tokens"] < 3_000 + 2 * max(len(t) for t in corpus)
    build_dataset(tmp_path / "again", TextListSource(texts), tokenizer=str(gpt2_style), val_tokens=3_000,
                  test_tokens=2_000, batch_size=7)
    for split in ("train", "val", "test"):  # the same bytes whatever the batch size
        assert [p.read_bytes() for p in sorted((tmp_path / "ds" / split).iterdir())] == \
               [p.read_bytes() for p in sorted((tmp_path / "again" / split).iterdir())]


def test_a_small_max_tokens_still_fills_val_and_test(tmp_path: Path, gpt2_style: Path, corpus: list[str]):
    summary = build_dataset(tmp_path / "ds", TextListSource(corpus), tokenizer=str(gpt2_style), max_tokens=1_000)
    assert summary["splits"]["train"]["tokens"] == 1_000 and summary["stopped_at_budget"]
    expected = held_out_oracle(corpus, gpt2_style, {"val": 1_048_576, "test": 1_048_576})
    assert documents_of(tmp_path / "ds", "val") == expected["val"] and expected["val"]
    assert documents_of(tmp_path / "ds", "test") == expected["test"] and expected["test"]
    assert summary["budget"]["reached"] and not any(w.startswith("train has") for w in summary["warnings"])


def test_a_long_held_out_document_that_meets_the_target_past_the_budget_is_written_whole(tmp_path: Path,
                                                                                        gpt2_style: Path):
    from nanopt.data.tokenize.documents import MAX_PIECE_CHARS

    body = " ".join(english_like_documents(800, seed=8, max_sentences=8))
    long = next(text for seed in range(200) if split_of((text := f"{seed} {body}").encode(), SHARE, SHARE) == "test")
    assert len(long) > MAX_PIECE_CHARS  # encoded in two pieces: with batch_size 1, one per batch
    # Train reaches its budget and val its target first, and the long document is the first held out for test.
    texts = [t for t in english_like_documents(40, seed=9) if split_of(t.encode(), SHARE, SHARE) != "test"] + [long]
    assert "val" in [split_of(t.encode(), SHARE, SHARE) for t in texts]
    for batch_size in (1, 256):
        out = tmp_path / f"batch-{batch_size}"
        build_dataset(out, TextListSource(texts), tokenizer=str(gpt2_style), max_tokens=500, val_tokens=1,
                      test_tokens=100, batch_size=batch_size)
        assert documents_of(out, "test")[-1] == long  # not cut off when its first piece met the target
    assert [p.read_bytes() for p in sorted((tmp_path / "batch-1").glob("*/*.npy"))] == \
           [p.read_bytes() for p in sorted((tmp_path / "batch-256").glob("*/*.npy"))]


def test_a_run_sets_the_targets_and_a_split_too_small_for_its_eval_window_is_warned_about(
        tmp_path: Path, gpt2_style: Path, corpus: list[str], cli_in_process):
    jsonl = write_jsonl(tmp_path / "mine.jsonl", corpus)
    run = write_run(tmp_path / "run", eval_tokens=4_096, micro_batch_size=1, global_batch_tokens=8_192)
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "max_position_embeddings": 8_192}))  # windows of 8,193
    result = cli_in_process("tokenize", jsonl, "--tokenizer", gpt2_style, "--run", run, "--out", tmp_path / "data",
                            "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    expected = held_out_oracle(corpus, gpt2_style, {"val": 4_096, "test": 4_096})
    assert documents_of(tmp_path / "data", "val") == expected["val"]
    for split in ("val", "test"):
        tokens = summary["splits"][split]["tokens"]
        assert 4_096 <= tokens < 8_193
        assert any(f"split '{split}' has {tokens:,} tokens, fewer than one evaluation window of {run} "
                   "(seq_len 8192 + 1 = 8,193)" in w for w in summary["warnings"])
    assert_user_error(cli_in_process("tokenize", jsonl, "--tokenizer", gpt2_style, "--run", tmp_path / "nowhere",
                                     "--out", tmp_path / "other"), "run directory not found")
    assert not (tmp_path / "other").exists()


def test_help_names_the_held_out_options():
    from typer.testing import CliRunner

    from nanopt.cli import app

    text = " ".join(CliRunner().invoke(app, ["tokenize", "--help"], env={"COLUMNS": "200"}).output.split())
    for option in ("--val-tokens", "--test-tokens", "--val-fraction", "--run"):
        assert option in text
    assert ("nanopt tokenize mine.jsonl --tokenizer gpt2 --max-tokens chinchilla --run runs/gpt2-small --out data/mine"
            in text and "nanopt tokenize more.jsonl --tokenizer data/mine --out data/more" in text)


# ------------------------------------------------------------------------------------- 8. the end-of-text token


@pytest.mark.parametrize("specials, config_eos, expected", [
    (["<|endoftext|>"], None, "<|endoftext|>"),  # GPT-2, StarCoder
    (["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"], None, "<|end_of_text|>"),  # Llama 3
    (["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"], "<|eot_id|>", "<|end_of_text|>"),  # Llama 3 Instruct
    (["<unk>", "<s>", "</s>"], None, "</s>"),  # Llama 2, Mistral
    (["<bos>", "<end_of_turn>", "<eos>"], None, "<eos>"),  # Gemma
    (["<PRE>", "<SUF>", "<MID>", "<EOT>"], None, "<EOT>"),
    (["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"], None,
     "<\uff5cend\u2581of\u2581sentence\uff5c>"),  # DeepSeek
    (["<|im_start|>", "<|im_end|>", "<|endoftext|>"], "<|im_end|>", "<|endoftext|>"),  # Qwen Instruct
    (["<|endoftext|>", "</s>"], "</s>", "</s>"),  # the config's choice among document separators
    (["</s>", "<|endoftext|>"], None, "<|endoftext|>"),  # else the fixed priority
], ids=["gpt2", "llama3", "llama3-instruct", "llama2", "gemma", "eot", "deepseek", "qwen-instruct",
        "config-first", "priority"])
def test_the_document_end_token_of_well_known_tokenizers_is_found(tmp_path: Path, specials: list[str],
                                                                   config_eos: str | None, expected: str):
    path = train_bpe_file(tmp_path, specials, config_eos)
    named = load_tokenizer(str(path))
    assert (named.eos_token, named.eos_id) == (expected, named.tokenizer.token_to_id(expected))


def test_a_tokenizer_with_only_a_chat_end_of_turn_token_asks_which_to_use(tmp_path: Path):
    path = train_bpe_file(tmp_path, ["<|im_start|>", "<|im_end|>"])
    with pytest.raises(DataError, match="cannot tell which token ends a document") as info:
        load_tokenizer(str(path))
    assert "<|im_end|> ends a chat turn" in str(info.value) and "--eos-token '<|im_end|>'" in info.value.hint
    assert load_tokenizer(str(path), eos_token="<|im_end|>").eos_token == "<|im_end|>"


def test_a_dataset_directory_as_tokenizer_lends_its_tokenizer_and_eos(tmp_path: Path, corpus: list[str]):
    path = train_bpe_file(tmp_path / "tok", ["<|endoftext|>", "<sep>"])
    first = tmp_path / "first"
    build_dataset(first, TextListSource(corpus[:20]), tokenizer=str(path), eos_token="<sep>")
    build_dataset(tmp_path / "second", TextListSource(corpus[20:40]), tokenizer=str(first))
    a, b = (json.loads((tmp_path / name / "meta.json").read_text()) for name in ("first", "second"))
    assert (b["eos_token"], b["eos_id"]) == (a["eos_token"], a["eos_id"]) == ("<sep>", a["eos_id"])
    assert b["tokenizer"]["sha256"] == a["tokenizer"]["sha256"]
    assert b["tokenizer"]["dataset"] == str(first)


# ------------------------------------------------------------------------------------- a stray log line


def test_a_malformed_jsonl_is_one_line_without_the_datasets_log(tmp_path: Path, gpt2_style: Path, cli_in_process):
    import datasets  # noqa: F401  (its logger and the handler it writes to stderr through)

    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    handlers = [h for h in logging.getLogger("datasets").handlers if isinstance(h, logging.StreamHandler)]
    assert handlers  # the library's own handler: what printed the stray line
    shown, streams = io.StringIO(), [h.stream for h in handlers]
    for handler in handlers:
        handler.stream = shown  # not setStream: it flushes the old stream, which may be an earlier test's capture
    try:
        result = cli_in_process("tokenize", broken, "--tokenizer", gpt2_style, "--out", tmp_path / "out")
    finally:
        for handler, stream in zip(handlers, streams, strict=True):
            handler.stream = stream
    assert_user_error(result, "broken.jsonl: reading failed")
    assert shown.getvalue() == ""
    assert not (tmp_path / "out").exists()
