"""What a user of `datasets` and transformers already has, brought to `nanopt tokenize` as is, without converting
it first.

- A directory written by `save_to_disk` (a Dataset, or a DatasetDict and its --split) reads as `load_from_disk`
  reads it: the same documents, hence the same shards, as the same rows in a .jsonl file.
- A tokenizer directory of GPT-2's vocab.json + merges.txt encodes as transformers' tokenizer of that directory,
  with `<|endoftext|>` as the end-of-text token.
- `--tokenizer NAME` where the hub cannot be reached fails at once in one line naming HF_HUB_OFFLINE (not after
  huggingface_hub's retries, logged on stderr), or loads the copy in the local Hugging Face cache; a hub dataset
  fails at once too.
- `--sample FRACTION --sample-seed N`: a random subset of any source's documents, the same for the same seed, in
  source order; through the hub's streaming code path the same subset as from the files themselves.
- A bare `datasets` builder name (`json`, `parquet`, `text`, `csv`) is refused at once: `datasets` would scan the
  working directory; the files must be named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error, run_cli
from conftest import english_like_documents, write_jsonl
from test_tokenize_newcomer import documents_of, train_bpe_file

from nanopt.data.tokenize.pipeline import build_dataset

SPLITS = ("train", "val", "test")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_file(tmp_path_factory.mktemp("bpe"), ["<|endoftext|>"])


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return english_like_documents(160, seed=29)


def all_documents(dataset: Path) -> dict[str, list[str]]:
    return {split: documents_of(dataset, split) for split in SPLITS}


# ------------------------------------------------------------------------------------------------ save_to_disk


def test_a_saved_dataset_gives_the_shards_of_the_same_rows_in_jsonl(tmp_path: Path, bpe: Path, corpus: list[str]):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"id": list(range(len(corpus))), "text": corpus}).save_to_disk(tmp_path / "saved")
    build_dataset(tmp_path / "from-saved", str(tmp_path / "saved"), tokenizer=str(bpe))
    build_dataset(tmp_path / "from-jsonl", str(write_jsonl(tmp_path / "corpus.jsonl", corpus)), tokenizer=str(bpe))
    saved, jsonl = all_documents(tmp_path / "from-saved"), all_documents(tmp_path / "from-jsonl")
    assert saved == jsonl and sum(map(len, saved.values())) == len(corpus)
    meta = json.loads((tmp_path / "from-saved" / "meta.json").read_text())
    assert meta["source"]["kind"] == "saved" and meta["source"]["rows"] == len(corpus)


def test_a_saved_dataset_dict_reads_the_split_asked_for(tmp_path: Path, bpe: Path, corpus: list[str],
                                                         cli_in_process):
    datasets = pytest.importorskip("datasets")
    train, validation = corpus[:100], corpus[100:]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": train}),
                          "validation": datasets.Dataset.from_dict({"text": validation})}
                         ).save_to_disk(tmp_path / "saved")
    result = cli_in_process("tokenize", tmp_path / "saved", "--split", "validation", "--tokenizer", bpe,
                            "--out", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    read = all_documents(tmp_path / "out")
    assert sorted(d for split in SPLITS for d in read[split]) == sorted(validation)

    missing = cli_in_process("tokenize", tmp_path / "saved", "--split", "test", "--tokenizer", bpe,
                             "--out", tmp_path / "none")
    assert_user_error(missing, "no split 'test'", "splits: train, validation", "--split")
    assert not (tmp_path / "none").exists()


# ------------------------------------------------------------------------------------ vocab.json + merges.txt

TRICKY = ["Hello world", " leading space and  two", "tabs\tand\nnewlines\r\n", "naïve café — “quotes” 日本語 🙂",
          "ends<|endoftext|>starts again", "", "   ", "1234567890 +-*/ x_y"]


def gpt2_files(folder: Path, **tokenizer_config: object) -> Path:
    """GPT-2's original tokenizer form: a byte-level BPE's vocab.json and merges.txt (what tokenizers' model.save
    writes, "#version" line included), and tokenizer_config.json when settings are given."""
    tokenizer_json = train_bpe_file(folder / "source", ["<|endoftext|>"])
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(tokenizer_json)).model.save(str(folder))
    if tokenizer_config:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.mark.parametrize("settings", [{}, {"add_prefix_space": True, "eos_token": "<|endoftext|>"}],
                         ids=["files-only", "with-tokenizer-config"])
def test_vocab_and_merges_encode_as_transformers_loads_them(tmp_path: Path, corpus: list[str], settings: dict):
    transformers = pytest.importorskip("transformers")
    from nanopt.data.tokenizers.tokenizer import load_tokenizer

    folder = gpt2_files(tmp_path / "gpt2", **settings)
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == sorted(
        ["vocab.json", "merges.txt", *(["tokenizer_config.json"] if settings else [])])
    ours = load_tokenizer(str(folder))
    theirs = transformers.GPT2TokenizerFast.from_pretrained(str(folder))
    assert (ours.eos_token, ours.eos_id) == (theirs.eos_token, theirs.eos_token_id) == ("<|endoftext|>", 0)
    assert ours.vocab_size == len(theirs)
    for text in TRICKY + corpus[:40]:
        assert ours.tokenizer.encode(text).ids == theirs(text).input_ids, text


def test_tokenize_takes_a_vocab_and_merges_directory(tmp_path: Path, corpus: list[str], cli_in_process):
    folder = gpt2_files(tmp_path / "gpt2")
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", corpus)
    result = cli_in_process("tokenize", jsonl, "--tokenizer", folder, "--out", tmp_path / "out", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["tokenizer"]["source"] == str(folder) and summary["tokenizer"]["eos_token"] == "<|endoftext|>"
    assert sum(map(len, all_documents(tmp_path / "out").values())) == len(corpus)

    (folder / "merges.txt").write_text("#version: 0.2\nh e x\n")
    broken = cli_in_process("tokenize", jsonl, "--tokenizer", folder, "--out", tmp_path / "none")
    assert_user_error(broken, "merges.txt: line 2 is not two tokens")
    assert not (tmp_path / "none").exists()


# ------------------------------------------------------------------------------------------ a bare builder name


@pytest.mark.parametrize("name", ["json", "parquet", "text", "csv", "JSON"])
def test_a_bare_builder_name_is_refused_at_once(tmp_path: Path, name: str, monkeypatch, cli_in_process):
    """`datasets` takes "json" without data_files as "every JSON file under the working directory": nanopt says
    at once that the files must be named, instead of scanning and failing on whatever it finds."""
    (tmp_path / "notes.json").write_text('{"not": "a corpus"')  # what `datasets` would scan, then fail on
    monkeypatch.chdir(tmp_path)
    result = cli_in_process("tokenize", name, "--vocab-size", "300", "--out", tmp_path / "out")
    assert_user_error(result, f"{name}: a `datasets` builder name", "pass the files themselves", "--out DIR")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------- the hub, unreachable


def unreachable_hub(tmp_path: Path) -> dict[str, str]:
    """An endpoint that refuses connections (port 9 of this machine: nothing listens), an empty cache, no proxy."""
    return {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "",
            "HTTPS_PROXY": "", "https_proxy": "", "HTTP_PROXY": "", "http_proxy": "", "ALL_PROXY": "", "all_proxy": ""}


def test_a_hub_tokenizer_without_the_hub_fails_at_once_naming_hf_hub_offline(tmp_path: Path):
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", ["a small document"])
    result = run_cli("tokenize", jsonl, "--tokenizer", "gpt2", "--out", tmp_path / "out", env=unreachable_hub(tmp_path))
    assert_user_error(result, "tokenizer 'gpt2'", "hub cannot be reached", "127.0.0.1:9", "HF_HUB_OFFLINE=1")
    assert not (tmp_path / "out").exists()


def test_a_hub_tokenizer_in_the_local_cache_loads_without_the_hub(tmp_path: Path, bpe: Path, corpus: list[str]):
    """The cache as huggingface_hub lays it out: a snapshot per commit, refs/main naming it."""
    repo = tmp_path / "hf" / "hub" / "models--someone--tok"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "tokenizer.json").write_bytes(bpe.read_bytes())
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", corpus[:30])
    result = run_cli("tokenize", jsonl, "--tokenizer", "someone/tok", "--out", tmp_path / "out", "--json",
                     env=unreachable_hub(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokenizer"]["source"] == "someone/tok"
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (bpe.parent / "tokenizer.json").read_text()


def test_a_hub_dataset_without_the_hub_fails_at_once(tmp_path: Path):
    result = run_cli("tokenize", "someone/corpus", "--vocab-size", "300", "--out", tmp_path / "out",
                     env=unreachable_hub(tmp_path))
    assert_user_error(result, "dataset someone/corpus", "hub cannot be reached", "127.0.0.1:9", "local files")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------- --sample


def kept(dataset: Path) -> list[str]:
    """Every document of a dataset, whatever its split."""
    return [d for split in SPLITS for d in documents_of(dataset, split)]


def test_sample_keeps_a_seeded_share_of_the_documents_in_source_order(tmp_path: Path, bpe: Path,
                                                                     corpus: list[str]):
    from nanopt.data.corpus.sources import TextListSource

    def sample(name: str, fraction: float, seed: int) -> list[str]:
        build_dataset(tmp_path / name, TextListSource(corpus), tokenizer=str(bpe), sample=fraction, sample_seed=seed)
        return kept(tmp_path / name)

    third = sample("a", 1 / 3, 7)
    assert 25 <= len(third) <= 80  # 160 documents, each kept with probability 1/3 (expected 53)
    assert sorted(third) == sorted(sample("again", 1 / 3, 7))  # the same seed, the same documents
    assert set(third) != set(sample("other", 1 / 3, 8))
    assert set(third) <= set(corpus)
    half = sample("half", 1 / 2, 7)
    assert set(third) <= set(half) and len(half) > len(third)  # the same draws: a larger share keeps a superset
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["source"]["sample"] == {"fraction": 1 / 3, "seed": 7} and meta["settings"]["sample"] == 1 / 3
    positions = [corpus.index(d) for d in documents_of(tmp_path / "a", "train")]
    assert positions == sorted(positions)  # train keeps the source's order


def test_sample_of_a_streamed_hub_dataset_is_the_sample_of_its_files(tmp_path: Path, bpe: Path, corpus: list[str]):
    pytest.importorskip("datasets")
    from nanopt.data.corpus.sources import HubSource

    folder = tmp_path / "hub-like"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", corpus)
    # The hub code path (load_dataset(name, split=..., streaming=True)) on a local dataset folder.
    build_dataset(tmp_path / "hub", HubSource(str(folder), None, "train", "text"), tokenizer=str(bpe), sample=0.25,
                  sample_seed=3)
    build_dataset(tmp_path / "files", str(folder), tokenizer=str(bpe), sample=0.25, sample_seed=3)
    assert all_documents(tmp_path / "hub") == all_documents(tmp_path / "files")
    assert 0 < len(kept(tmp_path / "hub")) < len(corpus)


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.1"])
def test_a_sample_outside_0_to_1_is_one_line(tmp_path: Path, bpe: Path, fraction: str, cli_in_process):
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", ["a document"])
    result = cli_in_process("tokenize", jsonl, "--tokenizer", bpe, "--sample", fraction, "--out", tmp_path / "out")
    assert_user_error(result, f"--sample {float(fraction)} is outside (0, 1]")
    assert not (tmp_path / "out").exists()
