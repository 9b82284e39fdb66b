"""`nanopt tokenize`: sources through `datasets`, determinism, splits, shard format, budgets and user errors."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from clihelp import assert_user_error, run_cli
from conftest import TINY_SETTINGS, english_like_documents, write_jsonl

from nanopt.data.budget import chinchilla_tokens, parse_token_count, resolve_max_tokens
from nanopt.data.corpus.sources import HubSource, StdlibSource, TextListSource
from nanopt.data.dataset import TokenDataset
from nanopt.data.tokenize.documents import split_of
from nanopt.data.tokenize.pipeline import build_dataset
from nanopt.data.tokenizers.tokenizer import load_tokenizer
from nanopt.errors import ConfigError, DataError


def shard_bytes(dataset: Path) -> dict[str, bytes]:
    return {p.relative_to(dataset).as_posix(): p.read_bytes() for p in sorted(dataset.glob("*/shard-*.npy"))}


def split_documents(dataset: Path, split: str) -> list[tuple[int, ...]]:
    """The token ids of each document of a split, cut at the EOS separators."""
    ds = TokenDataset.open(dataset)
    stream = np.concatenate([np.asarray(a) for a in ds.stream(split).arrays] or [np.zeros(0, np.uint16)])
    ends = np.flatnonzero(stream == ds.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tuple(stream[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def decoded_documents(dataset: Path, split: str) -> list[str]:
    tok = load_tokenizer(str(dataset / "tokenizer.json")).tokenizer
    return [tok.decode(list(doc)) for doc in split_documents(dataset, split)]


# ------------------------------------------------------------------------------------- sources and determinism


def test_tiny_dataset_splits_decode_back_to_the_source_documents(tiny_dataset: Path, tiny_corpus: Path):
    source = [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()]
    meta = json.loads((tiny_dataset / "meta.json").read_text())
    for split in ("train", "val", "test"):
        expected = [t for t in source if split_of(t.encode(), 0.1, 0.1) == split]
        assert decoded_documents(tiny_dataset, split) == expected  # in source order, each followed by EOS
        assert meta["splits"][split]["documents"] == len(expected)
        assert meta["splits"][split]["bytes"] == sum(len(t.encode()) for t in expected)
    assert meta["splits"]["train"]["tokens"] >= 100_000
    assert min(meta["splits"]["val"]["tokens"], meta["splits"]["test"]["tokens"]) >= 8_000


def test_same_source_and_settings_give_byte_identical_datasets(tiny_dataset: Path, tiny_corpus: Path,
                                                               tmp_path: Path):
    build_dataset(tmp_path / "again", str(tiny_corpus), **TINY_SETTINGS)
    assert shard_bytes(tmp_path / "again") == shard_bytes(tiny_dataset)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tiny_dataset / "tokenizer.json").read_bytes()
    assert len(shard_bytes(tiny_dataset)) > 3  # several shards, so shard cutting is covered too


def test_parquet_hub_path_and_batch_size_give_the_same_shards_as_jsonl(tiny_dataset: Path, tiny_corpus: Path,
                                                                      tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()]
    folder = tmp_path / "parquet"
    folder.mkdir()
    for part in range(2):  # two files: sorted order must keep the documents in sequence
        chunk = texts[part * 250:(part + 1) * 250]
        pq.write_table(pa.table({"content": chunk, "n": list(range(len(chunk)))}), folder / f"part-{part}.parquet")
    settings = {k: v for k, v in TINY_SETTINGS.items() if k != "vocab_size"}
    tokenizer = str(tiny_dataset / "tokenizer.json")
    build_dataset(tmp_path / "pq", str(folder), tokenizer=tokenizer, text_column="content", batch_size=7,
                  **settings)
    assert shard_bytes(tmp_path / "pq") == shard_bytes(tiny_dataset)
    # The hub code path (load_dataset(name, split=..., streaming=True)) on a local dataset folder.
    build_dataset(tmp_path / "hub", HubSource(str(folder), None, "train", "content"), tokenizer=tokenizer,
                  **settings)
    assert shard_bytes(tmp_path / "hub") == shard_bytes(tiny_dataset)


def test_split_is_a_function_of_the_text_alone(tiny_dataset: Path, tiny_corpus: Path, tmp_path: Path):
    texts = [json.loads(line)["text"] for line in tiny_corpus.read_text().splitlines()]
    settings = {k: v for k, v in TINY_SETTINGS.items() if k != "vocab_size"}
    build_dataset(tmp_path / "rev", TextListSource(texts[::-1] + texts[:50]),
                  tokenizer=str(tiny_dataset / "tokenizer.json"), **settings)
    for split in ("train", "val", "test"):  # other order, duplicates: every copy lands in its original's split
        reversed_docs = split_documents(tmp_path / "rev", split)
        original = split_documents(tiny_dataset, split)
        assert sorted(set(reversed_docs)) == sorted(original)
    shares = [split_of(f"document {i}".encode(), 0.1, 0.05) for i in range(20_000)]
    assert abs(shares.count("val") / 20_000 - 0.1) < 0.01
    assert abs(shares.count("test") / 20_000 - 0.05) < 0.01


def test_shards_are_standard_npy_files_with_recorded_checksums(tiny_dataset: Path):
    meta = json.loads((tiny_dataset / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512 and meta["format_version"] == 1
    for info in meta["splits"].values():
        for shard in info["shards"]:
            path = tiny_dataset / shard["file"]
            array = np.load(path, mmap_mode="r")
            assert array.dtype == np.uint16 and array.shape == (shard["tokens"],)
            assert shard["tokens"] <= TINY_SETTINGS["shard_tokens"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
            reference = io.BytesIO()
            np.save(reference, np.asarray(array))
            assert reference.getvalue() == path.read_bytes()  # byte for byte what NumPy itself writes
        assert sum(s["tokens"] for s in info["shards"]) == info["tokens"]
        assert info["max_token_id"] < 512
    TokenDataset.open(tiny_dataset).verify()


def test_builtin_corpus_reads_sorted_files_and_skips_tests_site_packages_and_empties(tmp_path: Path):
    root = tmp_path / "lib"
    for name, data in {"os.py": b"import sys\n", "json/__init__.py": b'"""JSON."""\n', "LICENSE.txt": b"PSF\n",
                       "bad.py": b"x = '\xff\xfe'\n", "empty.py": b"  \n", "test/test_os.py": b"skip me",
                       "site-packages/numpy/core.py": b"skip me", "email/architecture.rst": b"Docs\n",
                       "logo.png": b"skip me"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    source = StdlibSource(root)
    assert [p.relative_to(root).as_posix() for p in source.files()] == [
        "LICENSE.txt", "bad.py", "email/architecture.rst", "empty.py", "json/__init__.py", "os.py"]
    summary = build_dataset(tmp_path / "out", source, vocab_size=300, val_fraction=0.0, test_fraction=0.0)
    assert summary["empty_documents_skipped"] == 1 and summary["splits"]["train"]["documents"] == 5
    assert "x = '\ufffd\ufffd'\n" in decoded_documents(tmp_path / "out", "train")


def test_max_tokens_stops_exactly_at_the_train_budget(tiny_dataset: Path, tiny_corpus: Path, tmp_path: Path):
    settings = {k: v for k, v in TINY_SETTINGS.items() if k != "vocab_size"}
    summary = build_dataset(tmp_path / "cut", str(tiny_corpus), tokenizer=str(tiny_dataset / "tokenizer.json"),
                            max_tokens=12_345, **settings)
    assert summary["splits"]["train"]["tokens"] == 12_345 and summary["stopped_at_budget"]
    full = np.concatenate([np.asarray(a) for a in TokenDataset.open(tiny_dataset).stream("train").arrays])
    cut = np.concatenate([np.asarray(a) for a in TokenDataset.open(tmp_path / "cut").stream("train").arrays])
    assert np.array_equal(cut, full[:12_345])  # a prefix of the full run: it simply stops


@pytest.mark.parametrize("text, expected", [("3.3B", 3_300_000_000), ("20e9", 20_000_000_000),
                                            ("500M", 500_000_000), ("2.5k", 2_500), ("1_000_000", 1_000_000),
                                            ("123456", 123_456), ("1.5T", 1_500_000_000_000), (" 7 m ", 7_000_000)])
def test_token_counts_parse_exactly(text: str, expected: int):
    assert parse_token_count(text, "--max-tokens") == expected


@pytest.mark.parametrize("text", ["1.5", "0", "-5", "abc", "1e-3", "2.5X", "", "5 B tokens"])
def test_bad_token_counts_are_config_errors(text: str):
    with pytest.raises(ConfigError, match="--max-tokens"):
        parse_token_count(text, "--max-tokens")


def test_chinchilla_budget_needs_a_run_and_is_20_tokens_per_parameter(tmp_path: Path):
    from nanopt.config import load_run
    from nanopt.model.flops import count_params

    run = Path(__file__).resolve().parents[1] / "runs" / "demo"
    at_chinchilla = load_run(run, {"train_tokens": chinchilla_tokens(run), "max_steps": None})
    assert resolve_max_tokens("chinchilla", run) == at_chinchilla.total_tokens + 1
    assert chinchilla_tokens(run) == 20 * count_params(load_run(run).model).total
    assert resolve_max_tokens(None) is None
    with pytest.raises(ConfigError, match="--run"):
        resolve_max_tokens("chinchilla")
    assert resolve_max_tokens(None, run) is None  # --run alone sizes val and test (test_tokenize_newcomer.py)


# ------------------------------------------------------------------------------------- tokenizers


def test_loaded_tokenizer_eos_comes_from_special_tokens_or_tokenizer_config(tmp_path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<sep>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<sep>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match="cannot tell which token ends a document") as info:
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert "--eos-token" in info.value.hint
    assert load_tokenizer(str(tmp_path), eos_token="<sep>").eos_id == 1
    with pytest.raises(DataError, match="not in the vocabulary"):
        load_tokenizer(str(tmp_path), eos_token="<eos>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<sep>"}}))
    named = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (named.eos_token, named.eos_id) == ("<sep>", 1)
    texts = ["hello world", "world hello hello", "", "hello"]
    summary = build_dataset(tmp_path / "out", TextListSource(texts), tokenizer=str(tmp_path), val_fraction=0.0,
                            test_fraction=0.0)
    assert summary["splits"]["train"]["tokens"] == 2 + 3 + 1 + 3 and summary["empty_documents_skipped"] == 1
    stream = TokenDataset.open(tmp_path / "out").stream("train").arrays[0]
    assert stream.tolist() == [2, 3, 1, 3, 2, 2, 1, 2, 1]


def test_trained_tokenizer_uses_endoftext_and_round_trips_bytes(tiny_dataset: Path):
    named = load_tokenizer(str(tiny_dataset))
    assert named.eos_token == "<|endoftext|>" and named.vocab_size == 512
    text = "Bytes \u00e9\u4e2d\U0001f600 never seen in training \x00!"
    assert named.tokenizer.decode(named.tokenizer.encode(text).ids) == text  # byte-level: nothing is unknown


# ------------------------------------------------------------------------------------- robustness and errors


def test_existing_output_needs_force_and_force_only_replaces_datasets(tiny_dataset: Path, tmp_path: Path):
    out = tmp_path / "ds"
    shutil.copytree(tiny_dataset, out)
    with pytest.raises(DataError, match="already exists"):
        build_dataset(out, TextListSource(["a b c"] * 3), vocab_size=300)
    summary = build_dataset(out, TextListSource(["one document"]), vocab_size=300, force=True, val_fraction=0.0,
                            test_fraction=0.0)
    assert summary["documents"] == 1 and TokenDataset.open(out).split_tokens("train") == summary["tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no staging or replaced directories left
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    with pytest.raises(DataError, match="not a nanopt dataset"):
        build_dataset(precious, TextListSource(["x"]), vocab_size=300, force=True)
    assert (precious / "notes.txt").read_text() == "keep"


class _FailingSource(TextListSource):
    """A real source that dies part-way, like a network stream dropping or Ctrl-C."""

    def texts(self):
        yield from self._texts[:40]
        raise KeyboardInterrupt


def test_interrupted_run_leaves_nothing_that_looks_like_a_dataset(tmp_path: Path):
    with pytest.raises(KeyboardInterrupt):
        build_dataset(tmp_path / "ds", _FailingSource(english_like_documents(80)), vocab_size=300, batch_size=8,
                      shard_tokens=500)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="not found"):
        TokenDataset.open(tmp_path / "ds")


def test_undecodable_bytes_and_lone_surrogates_are_replaced(tmp_path: Path):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait\n\nsecond paragraph\n")
    (tmp_path / "b.jsonl").write_text('{"text": "caf\\u00e9"}\n{"text": null}\n{"text": "ok"}\n')
    summary = build_dataset(tmp_path / "ds", str(tmp_path), vocab_size=300, val_fraction=0.0, test_fraction=0.0)
    docs = decoded_documents(tmp_path / "ds", "train")
    assert docs == ["caf\u00e9", "ok", "caf\ufffd au lait\n\nsecond paragraph\n"]  # json, then text files
    assert summary["empty_documents_skipped"] == 1
    # Python strings can hold lone surrogates (e.g. from a dataset's own decoding); they cannot be tokenized as is.
    build_dataset(tmp_path / "s", TextListSource(["lone \ud800 surrogate"]), vocab_size=300, val_fraction=0.0,
                  test_fraction=0.0)
    assert decoded_documents(tmp_path / "s", "train") == ["lone \ufffd\ufffd\ufffd surrogate"]


def test_source_errors_are_data_errors_with_hints(tmp_path: Path):
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "   ", "\n"])
    with pytest.raises(DataError, match="no documents") as info:
        build_dataset(tmp_path / "o1", str(empty), tokenizer=str(_some_tokenizer(tmp_path)))
    assert info.value.hint
    with pytest.raises(DataError, match="no documents"):
        build_dataset(tmp_path / "o2", str(empty), vocab_size=300)
    with pytest.raises(DataError, match="no such file"):
        build_dataset(tmp_path / "o3", str(tmp_path / "missing.jsonl"), vocab_size=300)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match="no .txt, .json"):
        build_dataset(tmp_path / "o4", str(tmp_path / "folder"), vocab_size=300)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match="holds int"):
        build_dataset(tmp_path / "o5", str(numbers), vocab_size=300)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": "unterminated\n')
    with pytest.raises(DataError, match="broken.jsonl: reading failed"):
        build_dataset(tmp_path / "o6", str(broken), vocab_size=300)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def _some_tokenizer(tmp_path: Path) -> Path:
    build_dataset(tmp_path / "tok", TextListSource(english_like_documents(20)), vocab_size=300)
    return tmp_path / "tok" / "tokenizer.json"


@pytest.mark.parametrize("settings, fragment", [
    ({"tokenizer": "gpt2", "vocab_size": 1000}, "--vocab-size applies"),
    ({"vocab_size": 100}, "--vocab-size 100"),
    ({"val_fraction": 0.6, "test_fraction": 0.5, "vocab_size": 300}, "leave nothing"),
    ({"val_fraction": -0.1, "vocab_size": 300}, "--val-fraction"),
    ({"shard_tokens": 0, "vocab_size": 300}, "--shard-tokens"),
    ({"eos_token": "</s>", "vocab_size": 300}, "--eos-token"),
    ({}, "no tokenizer given"),
])
def test_bad_settings_are_config_errors(tmp_path: Path, settings: dict, fragment: str):
    with pytest.raises(ConfigError, match=fragment):
        build_dataset(tmp_path / "out", TextListSource(english_like_documents(5)), **settings)


# ------------------------------------------------------------------------------------- the command


def test_cli_builds_a_dataset_and_prints_json(tiny_corpus: Path, tmp_path: Path, cli_in_process):
    out = tmp_path / "cli"
    result = cli_in_process("tokenize", tiny_corpus, "--out", out, "--vocab-size", "300", "--val-fraction", "0.1",
                            "--test-fraction", "0.1", "--shard-tokens", "50k", "--max-tokens", "20k", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["splits"]["train"]["tokens"] == 20_000 and summary["splits"]["train"]["shards"] == 1
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["max_tokens"] == 20_000 and meta["source"]["kind"] == "files"
    assert_user_error(cli_in_process("tokenize", tiny_corpus, "--out", out, "--vocab-size", "300"), "already exists",
                      "--force")
    assert_user_error(cli_in_process("tokenize", tiny_corpus, "--out", tmp_path / "x", "--vocab-size", "300",
                                     "--text-column", "body"), "no text column 'body'", "text, id")
    assert_user_error(cli_in_process("tokenize", "--out", tmp_path / "y", "--max-tokens", "lots"), "--max-tokens")


def test_cli_help_shows_the_fineweb_example():
    result = run_cli("tokenize", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert ("nanopt tokenize HuggingFaceFW/fineweb-edu --config sample-10BT --tokenizer gpt2 --max-tokens 2.5B "
            "--out data/fineweb-edu") in text
    for option in ("--text-column", "--split", "--vocab-size", "--shard-tokens", "--val-fraction", "--force",
                   "--batch-size", "--threads", "--json"):
        assert option in text
