"""Local text and JSON files without the `datasets` library (an offline machine, the GPU image): the same documents in
the same order as `datasets` gives, hence the same shards; and what still needs `datasets` says so in one line.

`datasets` is made unimportable the way a machine without it is: `sys.modules["datasets"] = None` makes `import
datasets` raise ImportError. Where `datasets` is not installed the comparisons skip and the rest runs as it is.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import pytest
from conftest import TINY_SETTINGS

from nanopt.data.corpus.sources import FileSource
from nanopt.errors import DataError


@pytest.fixture
def without_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)


@pytest.fixture(scope="module")
def odd_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of every format the plain reader takes, with the details where two readers could part: a BOM, CRLF
    and lone CR line ends, blank lines, U+2028 / U+2029 / U+0085 inside JSON strings (str.splitlines would cut
    there), bytes that are not UTF-8, rows without the text column or with null, arrays of objects and of strings,
    compressed files, an empty file."""
    d = tmp_path_factory.mktemp("odd")
    rows = [{"text": "plain \u2028 separator\u2029 and \x85 next", "id": 1},
            {"text": "caf\u00e9 \U0001F600 emoji", "id": 2}, {"id": 3}, {"text": None, "id": 4},
            {"text": "tab\tand \"quotes\" and \\ back", "id": 5}]
    lines = [json.dumps(row) for row in rows]
    data = ("\r\n".join(lines[:2]) + "\n\n  \n" + "\n".join(lines[2:]) + "\n").encode().replace(b"emoji", b"emo\xffji")
    (d / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + data)
    (d / "b.json").write_text(json.dumps([{"text": "from an array", "id": 6}, {"text": "two\nlines", "id": 7}]))
    (d / "c.txt").write_bytes(b"first line\r\nsecond\rthird\n\n\npara two\n\n\n\npara three with \xe9 latin1\n\n")
    (d / "d.txt.gz").write_bytes(gzip.compress(b"gz line one\r\ngz para\n\ngz end"))
    (d / "e.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": "gz json", "id": 8}) + "\n").encode()))
    (d / "f.json").write_text(json.dumps(["only strings", "in this array"]))
    (d / "g.txt").write_bytes(b"")
    return d


def _documents(spec: Path, sample_by: str) -> list[str]:
    return list(FileSource(str(spec), sample_by=sample_by).texts())


@pytest.mark.parametrize("sample_by", ["document", "paragraph", "line"])
def test_without_datasets_local_files_are_the_same_documents_in_the_same_order(odd_corpus: Path, sample_by: str,
                                                                                monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("datasets")
    through_datasets = _documents(odd_corpus, sample_by)
    monkeypatch.setitem(sys.modules, "datasets", None)
    plain = _documents(odd_corpus, sample_by)
    assert plain == through_datasets
    # Not two readers agreeing on nothing: every file was read, U+FFFD stands for the bad bytes, rows without text
    # are empty documents.
    assert "caf\u00e9 \U0001F600 emo\ufffdji" in plain and "" in plain and "only strings" in plain
    assert any("gz para" in text for text in plain) and any("latin1" in text for text in plain)


def _digests(dataset: Path) -> dict[str, str]:
    """Every file of a dataset directory but meta.json (which records the time it took), by content."""
    return {str(p.relative_to(dataset)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(dataset.rglob("*")) if p.is_file() and p.name != "meta.json"}


def test_without_datasets_the_test_corpus_makes_the_same_dataset(tiny_corpus: Path, tiny_dataset: Path,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What conftest's tiny_dataset (the fixture of the GPU-marked tests) is on a machine without `datasets`: the
    very same shards, tokenizer and splits as where `datasets` reads the corpus."""
    from nanopt.data.tokenize.pipeline import build_dataset

    pytest.importorskip("datasets")  # tiny_dataset was read through it
    monkeypatch.setitem(sys.modules, "datasets", None)
    out = tmp_path / "plain"
    build_dataset(out, str(tiny_corpus), **TINY_SETTINGS)
    assert _digests(out) == _digests(tiny_dataset) and len(_digests(out)) > 3
    meta, reference = (json.loads((d / "meta.json").read_text()) for d in (out, tiny_dataset))
    assert meta["splits"] == reference["splits"] and meta["source"] == reference["source"]


def test_without_datasets_what_still_needs_it_is_one_line(tmp_path: Path, without_datasets: None, cli_in_process):
    from clihelp import assert_user_error

    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    for source in (str(tmp_path / "t.parquet"), "HuggingFaceFW/fineweb-edu"):
        result = cli_in_process("tokenize", source, "--out", tmp_path / "out", "--vocab-size", "300")
        assert_user_error(result, "needs the `datasets` package", "pip install datasets")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("content", "fragments"), [
    ('{"text": "fine"}\n[1, 2]\n', ("line 2 holds a JSON list, not an object",)),
    ('{"text": "fine"}\n{"text": oops}\n', ("line 2 is not valid JSON",)),
    ('{"body": "a"}\n{"id": 2}\n', ("no text column 'text'", "columns: body, id")),
    ('[{"text": "a"}, "b"]', ("item 1 of the array is a JSON str, not an object",)),
])
def test_without_datasets_a_malformed_json_file_is_a_data_error_naming_where(tmp_path: Path, content: str,
                                                                              fragments: tuple[str, ...],
                                                                              without_datasets: None):
    path = tmp_path / ("c.json" if content.startswith("[") else "c.jsonl")
    path.write_text(content)
    with pytest.raises(DataError) as caught:
        _documents(path, "document")
    for fragment in fragments:
        assert fragment in caught.value.message, caught.value.message
