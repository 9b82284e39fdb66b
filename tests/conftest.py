"""Shared fixtures: a small synthetic corpus and the dataset `nanopt tokenize` makes from it.

`tiny_dataset` goes through the real pipeline (a local jsonl file read with `datasets`, a trained byte-level BPE of
512 tokens, hash-based splits, .npy shards small enough that train spans several files) so every test that trains
or evaluates on it also exercises the data path.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

_SUBJECTS = ("the model", "a small network", "the optimizer", "every layer", "the tokenizer", "this corpus",
             "the gradient", "a careful engineer", "the scheduler", "our dataset", "the loss", "each rank")
_VERBS = ("reads", "updates", "predicts", "compresses", "measures", "learns", "writes", "checks", "splits",
          "shuffles", "averages", "remembers")
_OBJECTS = ("the next token", "long documents", "a few numbers", "the learning rate", "old checkpoints",
            "every batch", "its own mistakes", "the training loss", "quiet patterns", "simple words",
            "the memory map", "a stream of text")
_TAILS = ("before the run ends", "with great care", "on a cheap machine", "in a few minutes", "again and again",
          "without a single error", "while the fans spin", "as the days go by", "", "", "")
_SYLLABLES = ("ka", "lo", "mi", "ra", "te", "vo", "sun", "bel", "dor", "en", "qui", "zar", "po", "lis", "ne", "tur")


def _place(rng: random.Random) -> str:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
    return f"near {name}" if rng.random() < 0.5 else f"at {rng.randint(1, 9999)} {name} street"


def english_like_documents(count: int, seed: int = 0, min_sentences: int = 4, max_sentences: int = 30) -> list[str]:
    """Deterministic documents of simple English sentences, with enough repetition for a BPE to learn from."""
    rng = random.Random(seed)
    documents = []
    for number in range(count):
        sentences = []
        for _ in range(rng.randint(min_sentences, max_sentences)):
            words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS),
                     _place(rng) if rng.random() < 0.4 else ""]
            sentence = " ".join(w for w in words if w)
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice((".", ".", "!", "?")))
        documents.append(f"Note {number}. " + " ".join(sentences))
    return documents


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({column: text, "id": i}) + "\n")
    return path


def pytest_configure(config: pytest.Config) -> None:
    # One intra-op thread per process, as torchrun gives each rank (and the launcher each command). The models here
    # are tiny and two cores are shared by this process, its ranks, find-batch's trial processes and any other
    # work on the machine: OpenMP threads spinning for a busy core then cost several times the work they split.
    # Set before torch is imported, so this process and every process it starts inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


TINY_SETTINGS = {"vocab_size": 512, "val_fraction": 0.1, "test_fraction": 0.1, "shard_tokens": 40_000}


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl file of 500 synthetic documents (~0.5 MB)."""
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "tiny.jsonl", english_like_documents(500))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory, tiny_corpus: Path) -> Path:
    """A dataset directory: ~108k train tokens in 3 shards, ~14k val and ~10k test tokens, vocab 512."""
    from nanopt.data.tokenize.pipeline import build_dataset

    out = tmp_path_factory.mktemp("data") / "tiny"
    build_dataset(out, str(tiny_corpus), **TINY_SETTINGS)
    return out


@pytest.fixture(scope="session")
def mixture_sources(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> dict[str, Path]:
    """web (tiny_dataset), code and math: three datasets with one tokenizer, for the data-mixture tests."""
    from mixturehelp import build_sources

    return build_sources(tmp_path_factory.mktemp("mixture"), tiny_dataset)


@pytest.fixture
def cli_in_process(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """The CLI entry point run in this process: no torch import per call, so many cases stay fast."""
    from nanopt.cli import main

    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: object) -> SimpleNamespace:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory):
    """A process that has imported torch once and forks each `nanopt` command (see tests/faulthelp.py); one per
    test process, shared by every module (its import alone is several seconds of CPU)."""
    from faulthelp import Launcher

    warm = Launcher(tmp_path_factory.mktemp("logs"))
    yield warm
    warm.close()
