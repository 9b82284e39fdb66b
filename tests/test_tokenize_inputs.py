"""`nanopt tokenize` on inputs that used to corrupt a dataset silently or exhaust memory, and the Chinchilla budget
that must be exactly what `nanopt train` needs.

- Bytes that are not UTF-8 are counted per file, warned about once per file and recorded in meta.json; with
  `--on-decode-error refuse` the first one stops the run (file and byte offset named, nothing written).
- Files that are not text at all (binaries, images, a compressed file under a text name, UTF-16) are refused.
- A document of any length is encoded in bounded pieces cut before a space, so its ids equal the unsplit encoding
  and peak memory does not grow with the longest line.
- `--max-tokens chinchilla --run R` gives the run's Chinchilla budget rounded as training rounds it, plus the one
  token the last training window reads, and `nanopt train R` then runs to the end on it.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from clihelp import REPO, assert_user_error
from conftest import english_like_documents, write_jsonl
from faulthelp import tree_digest

from nanopt.data.corpus.sources import StdlibSource, TextListSource
from nanopt.data.dataset import TokenDataset
from nanopt.data.tokenize.pipeline import ProgressReporter, build_dataset
from nanopt.data.tokenizers.tokenizer import load_tokenizer, train_bpe
from nanopt.errors import DataError

NO_HELD_OUT = {"val_fraction": 0.0, "test_fraction": 0.0}


def undecodable_bytes(data: bytes) -> int:
    """The oracle: how many bytes Python's own UTF-8 decoder cannot decode (one escape character per byte)."""
    return sum(1 for ch in data.decode("utf-8", errors="surrogateescape") if "\udc80" <= ch <= "\udcff")


def train_stream(dataset: Path) -> np.ndarray:
    arrays = TokenDataset.open(dataset).stream("train").arrays
    return np.concatenate([np.asarray(a) for a in arrays]).astype(np.int64)


class CollectingReporter(ProgressReporter):
    """A real reporter that keeps the warnings the pipeline sends, as the CLI's renders them."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning:")]


# ------------------------------------------------------------------------------------- 8. bytes that are not UTF-8


@pytest.fixture
def mixed_corpus(tmp_path: Path) -> dict[str, Path]:
    """A folder of text, JSON lines and gzip-compressed JSON lines; three of them hold bytes that are not UTF-8."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = english_like_documents(60, seed=3)
    files = {
        "latin1": folder / "a-latin1.txt",
        "clean": folder / "b-clean.txt",
        "json": folder / "c-broken.jsonl",
        "gz": folder / "d-cut.jsonl.gz",
    }
    files["latin1"].write_bytes(("\n\n".join(texts[:20]) + "\n\nCafé crème, à la française.\n").encode("latin-1"))
    files["clean"].write_text("\n\n".join(texts[20:30]) + "\n\nCafé crème, déjà vu.\n", encoding="utf-8")
    records = [json.dumps({"text": t}).encode() for t in texts[30:45]]
    records[4] = b'{"text": "a stray \xff\xfe pair and a lone \x80 byte in ' + texts[34].encode() + b'"}'
    files["json"].write_bytes(b"\n".join(records) + b"\n")
    cut = [json.dumps({"text": t}).encode() for t in texts[45:]]
    cut[3] = b'{"text": "a euro sign cut short: \xe2\x82 and the end."}'
    files["gz"].write_bytes(gzip.compress(b"\n".join(cut) + b"\n"))
    return files


def expected_counts(files: dict[str, Path]) -> dict[str, int]:
    counts = {}
    for path in files.values():
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        if undecodable_bytes(data):
            counts[str(path)] = undecodable_bytes(data)
    return counts


def test_undecodable_bytes_are_counted_per_file_warned_once_and_recorded_in_meta(mixed_corpus: dict[str, Path],
                                                                                 tmp_path: Path, cli_in_process):
    expected = expected_counts(mixed_corpus)
    assert set(expected) == {str(mixed_corpus[k]) for k in ("latin1", "json", "gz")}
    out = tmp_path / "ds"
    result = cli_in_process("tokenize", mixed_corpus["clean"].parent, "--out", out, "--vocab-size", "300",
                            "--json", *_no_held_out_args())
    assert result.returncode == 0, result.stderr
    warnings = warning_lines(result.stderr)
    assert len(warnings) == len(expected), result.stderr  # once per file, though the BPE sample reads them too
    for path, count in expected.items():
        [line] = [w for w in warnings if path in w]
        assert f" {count} " in line and "U+FFFD" in line, line
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"]["undecodable_bytes"] == sum(expected.values())
    assert meta["source"]["undecodable_bytes_by_file"] == expected
    summary = json.loads(result.stdout)
    assert summary["undecodable_bytes"] == sum(expected.values())
    assert any(str(sum(expected.values())) in w and "U+FFFD" in w for w in summary["warnings"])
    tokenizer = load_tokenizer(str(out / "tokenizer.json")).tokenizer
    text = tokenizer.decode(train_stream(out).tolist())
    assert "a stray \ufffd" in text and "cut short: \ufffd and the end" in text  # JSON is replaced too, not refused


def test_refuse_names_the_file_and_byte_offset_exits_2_and_writes_nothing(mixed_corpus: dict[str, Path],
                                                                         tmp_path: Path, cli_in_process):
    latin1 = mixed_corpus["latin1"].read_bytes()
    offset = len(latin1.decode("utf-8", errors="surrogateescape").split("\udce9")[0].encode("utf-8",
                                                                                          "surrogateescape"))
    assert latin1[offset] == 0xE9  # "é" in Latin-1: the first byte that is not UTF-8
    before = tree_digest(tmp_path)
    result = cli_in_process("tokenize", mixed_corpus["clean"].parent / "*.txt", "--out", tmp_path / "ds",
                            "--vocab-size", "300", "--on-decode-error", "refuse")
    assert_user_error(result, str(mixed_corpus["latin1"]), f"byte {offset}", "--on-decode-error replace")
    assert tree_digest(tmp_path) == before and not (tmp_path / "ds").exists()


def test_refuse_counts_offsets_in_the_decompressed_text_and_covers_json(mixed_corpus: dict[str, Path],
                                                                        tmp_path: Path):
    """Offsets are those of the text a decompressing reader sees (what `zcat FILE | xxd` shows)."""
    for key in ("gz", "json"):
        path = mixed_corpus[key]
        data = gzip.decompress(path.read_bytes()) if key == "gz" else path.read_bytes()
        offset = next(i for i, ch in enumerate(data.decode("utf-8", "surrogateescape")) if "\udc80" <= ch)
        offset = len(data.decode("utf-8", "surrogateescape")[:offset].encode("utf-8", "surrogateescape"))
        with pytest.raises(DataError, match=f"byte {offset}") as info:
            build_dataset(tmp_path / key, str(path), vocab_size=300, on_decode_error="refuse", **NO_HELD_OUT)
        assert str(path) in info.value.message
        assert not (tmp_path / key).exists()
    build_dataset(tmp_path / "ok", str(mixed_corpus["clean"]), vocab_size=300, on_decode_error="refuse",
                  **NO_HELD_OUT)  # clean UTF-8 (with accents) passes


def test_the_builtin_corpus_counts_and_warns_through_the_reporter(tmp_path: Path):
    root = tmp_path / "stdlib"
    (root / "pkg").mkdir(parents=True)
    docs = english_like_documents(30, seed=4)
    for i, doc in enumerate(docs):
        (root / "pkg" / f"m{i:02d}.py").write_text(f'"""{doc}"""\n', encoding="utf-8")
    odd = root / "pkg" / "m05.py"
    odd.write_bytes(b'"""' + docs[5].encode() + b' na\xefve caf\xe9"""\n')
    reporter = CollectingReporter()
    summary = build_dataset(tmp_path / "ds", StdlibSource(root), progress=reporter, vocab_size=300, **NO_HELD_OUT)
    assert len(reporter.warnings) == 1 and "pkg/m05.py" in reporter.warnings[0] and " 2 " in reporter.warnings[0]
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["source"]["undecodable_bytes_by_file"] == {"pkg/m05.py": undecodable_bytes(odd.read_bytes())}
    assert summary["undecodable_bytes"] == 2
    with pytest.raises(DataError, match="m05.py"):
        build_dataset(tmp_path / "strict", StdlibSource(root), vocab_size=300, on_decode_error="refuse")


def test_many_files_with_bad_bytes_warn_one_by_one_up_to_a_limit_and_meta_has_them_all(tmp_path: Path):
    from nanopt.data.tokenize.pipeline import MAX_DECODE_WARNINGS

    folder = tmp_path / "corpus"
    folder.mkdir()
    docs = english_like_documents(MAX_DECODE_WARNINGS + 5, seed=15)
    for i, doc in enumerate(docs):
        (folder / f"{i:02d}.txt").write_bytes(doc.encode() + b" \xe9t\xe9" * (i % 3 + 1))
    reporter = CollectingReporter()
    build_dataset(tmp_path / "ds", str(folder), progress=reporter, vocab_size=300, **NO_HELD_OUT)
    assert len(reporter.warnings) == MAX_DECODE_WARNINGS + 1 and "meta.json" in reporter.warnings[-1]
    counts = json.loads((tmp_path / "ds" / "meta.json").read_text())["source"]["undecodable_bytes_by_file"]
    assert counts == {str(p): undecodable_bytes(p.read_bytes()) for p in sorted(folder.iterdir())}


def _not_text_files() -> dict[str, bytes]:
    rng = random.Random(0)
    prose = "\n\n".join(english_like_documents(10, seed=5))
    return {
        "photo.txt": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + rng.randbytes(4000),  # an image under a text name
        "notes.txt": gzip.compress(prose.encode()),  # a compressed file someone pointed at as text
        "letter.txt": prose.encode("utf-16"),  # text, but UTF-16: NUL bytes everywhere
        "records.jsonl": bytes(b for b in rng.randbytes(6000) if b),  # random bytes without a single NUL
        "cyrillic.txt": ("Привет, мир! Это обычный текст. " * 50).encode("cp1251"),  # text in another encoding
    }


@pytest.mark.parametrize("name", sorted(_not_text_files()))
def test_a_file_that_is_not_text_is_refused_with_one_line(name: str, tmp_path: Path, cli_in_process):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a-fine.txt").write_text("\n\n".join(english_like_documents(20, seed=6)), encoding="utf-8")
    bad = folder / name
    bad.write_bytes(_not_text_files()[name])
    before = tree_digest(tmp_path)
    result = cli_in_process("tokenize", folder, "--out", tmp_path / "ds", "--vocab-size", "300")
    assert_user_error(result, str(bad), "not UTF-8 text")
    assert tree_digest(tmp_path) == before and not (tmp_path / "ds").exists()


def test_a_compressed_text_file_with_bytes_that_are_not_utf8_is_refused_before_anything_is_written(
        tmp_path: Path, cli_in_process):
    """`datasets` decodes compressed text strictly whatever encoding_errors says, so such a file would stop the run
    part-way; it is refused up front instead, with how to make it readable."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    data = "\n\n".join(english_like_documents(20, seed=14)).encode() + b"\n\nna\xefve\n"
    (folder / "notes.txt.gz").write_bytes(gzip.compress(data))
    offset = data.index(b"\xef")
    before = tree_digest(tmp_path)
    result = cli_in_process("tokenize", folder, "--out", tmp_path / "ds", "--vocab-size", "300")
    assert_user_error(result, str(folder / "notes.txt.gz"), f"byte {offset} of the decompressed text", "gunzip")
    assert tree_digest(tmp_path) == before
    (folder / "notes.txt.gz").write_bytes(gzip.compress(data.replace(b"\xef", "ï".encode())))
    assert cli_in_process("tokenize", folder, "--out", tmp_path / "ds", "--vocab-size", "300").returncode == 0


# ------------------------------------------------------------------------------------- 9. documents of any length


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory):
    """A GPT-2-style byte-level BPE trained on English-like text (the tokenizer nanopt trains itself)."""
    return train_bpe(english_like_documents(300, seed=7), 600).tokenizer


def llama3_style_bpe():
    """A byte-level BPE with the Llama 3 pre-tokenizer regex, whose pre-tokens differ from GPT-2's around
    punctuation and newlines; the cut rule must hold for it too."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(english_like_documents(300, seed=8), trainer)
    return tokenizer


def awkward_text(seed: int) -> str:
    """English-like text with the whitespace that pre-tokenizers treat specially: runs of spaces, tabs, blank
    lines, spaces before newlines, punctuation before newlines, digits, contractions and non-ASCII letters."""
    rng = random.Random(seed)
    separators = (" ", " ", " ", "  ", "   ", "\n", "\n\n", " \n", ".\n", "\t", " \t ", "\r\n", "!  ", ", ")
    words = " ".join(english_like_documents(40, seed=seed)).split(" ")
    extra = ("it's", "we'll", "12345678", "3.14159", "naïve", "Ærøskøbing", "東京", "😀", "--", "(x)", "'quoted'")
    return "".join(rng.choice(words + list(extra)) + rng.choice(separators) for _ in range(6000))


@pytest.mark.parametrize("style", ["gpt2", "llama3"])
def test_pieces_cut_at_whitespace_encode_to_the_same_ids_as_the_whole(style: str, bpe):
    from nanopt.data.tokenizers.tokenizer import piece_ends

    tokenizer = bpe if style == "gpt2" else llama3_style_bpe()
    for seed in range(3):
        text = awkward_text(seed)
        for max_chars in (200, 333, 4096):
            ends = piece_ends(text, max_chars)
            starts = [0, *ends[:-1]]
            pieces = [text[a:b] for a, b in zip(starts, ends, strict=True)]
            assert "".join(pieces) == text and len(pieces) > 1
            assert all(0 < len(p) <= max_chars for p in pieces)
            # Every cut is before a space that follows a non-space, or before a newline that follows a letter or
            # digit: a pre-token boundary for both regexes.
            assert all((text[e] == " " and not text[e - 1].isspace()) or (text[e] == "\n" and text[e - 1].isalnum())
                       for e in ends[:-1])
            whole = tokenizer.encode(text, add_special_tokens=False).ids
            joined = [i for e in tokenizer.encode_batch(pieces, add_special_tokens=False) for i in e.ids]
            assert joined == whole, (style, seed, max_chars)


def test_text_without_spaces_is_cut_hard_at_the_bound_and_still_round_trips(bpe):
    """A minified dump or base64 has nowhere safe to cut: pieces end at the bound, ids may differ only around
    the cuts (merges across them are lost), and the bytes are all there."""
    from nanopt.data.tokenizers.tokenizer import piece_ends

    text = "".join(random.Random(1).choice("abcdefgh{}[]:,0123456789") for _ in range(10_000))
    ends = piece_ends(text, 1000)
    assert ends == list(range(1000, 10_001, 1000))
    pieces = [text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    ids = [i for e in bpe.encode_batch(pieces, add_special_tokens=False) for i in e.ids]
    assert bpe.decode(ids) == text


def long_document(chars: int, seed: int = 9) -> str:
    """One line of English-like words (a log line, a dump with spaces) of about `chars` characters."""
    text = " ".join(english_like_documents(200, seed=seed)).replace("\n", " ")
    return (text * (chars // len(text) + 1))[:chars]


def test_a_long_document_is_encoded_in_pieces_with_one_eos_and_the_same_ids(bpe, tmp_path: Path):
    from nanopt.data.tokenize.documents import MAX_PIECE_CHARS

    long = long_document(3 * MAX_PIECE_CHARS + 12_345)
    texts = english_like_documents(5, seed=10) + [long] + english_like_documents(3, seed=11)
    (tmp_path / "tokenizer.json").write_text(bpe.to_str())
    named = load_tokenizer(str(tmp_path / "tokenizer.json"))
    summary = build_dataset(tmp_path / "ds", TextListSource(texts), tokenizer=str(tmp_path / "tokenizer.json"),
                            **NO_HELD_OUT)
    expected = [i for t in texts for i in [*named.tokenizer.encode(t, add_special_tokens=False).ids, named.eos_id]]
    assert train_stream(tmp_path / "ds").tolist() == expected
    train = summary["splits"]["train"]
    assert train["documents"] == len(texts) and train["bytes"] == sum(len(t.encode()) for t in texts)
    assert train["mean_document_tokens"] == round((len(expected) - len(texts)) / len(texts), 3)

    # The budget cut lands inside the long document's second piece: the result is still a prefix of the above.
    before = sum(len(named.tokenizer.encode(t).ids) + 1 for t in texts[:5])
    budget = before + len(named.tokenizer.encode(long).ids) // 2
    cut = build_dataset(tmp_path / "cut", TextListSource(texts), tokenizer=str(tmp_path / "tokenizer.json"),
                        max_tokens=budget, **NO_HELD_OUT)
    assert train_stream(tmp_path / "cut").tolist() == expected[:budget] and cut["stopped_at_budget"]
    assert cut["splits"]["train"]["documents"] == 6


def _peak_rss_bytes(args: list[str], log: Path) -> int:
    """Peak resident memory of one real `nanopt` process, from the kernel's accounting of that child alone.

    USE_TORCH=0 (a variable of `datasets`, which a user may set too) keeps `datasets` from importing torch, which
    tokenizing never uses: several seconds of CPU per process, and ~300 MB of baseline that only blurs the
    comparison."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nanopt", *args], cwd=REPO, stdout=out, stderr=out,
                                env={**os.environ, "COLUMNS": "200", "USE_TORCH": "0"})
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.mark.slow
def test_peak_memory_of_one_long_line_stays_near_that_of_many_short_lines(bpe, tmp_path: Path):
    size = 8 << 20  # unsplit this needed ~1.1 GB: far past the bound below (short + 128 MiB), at half the time of 16
    line = long_document(size, seed=12)
    (tmp_path / "long.txt").write_text(line + "\n", encoding="utf-8")
    # The same bytes as ~100-character lines: many small documents.
    short = "\n".join(line[i:i + 100] for i in range(0, size, 100)) + "\n"
    (tmp_path / "short.txt").write_text(short, encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text(bpe.to_str())
    peaks = {}
    for name in ("short", "long"):
        peaks[name] = _peak_rss_bytes(["tokenize", str(tmp_path / f"{name}.txt"), "--out", str(tmp_path / name),
                                       "--sample-by", "line", "--tokenizer", str(tmp_path / "tokenizer.json"),
                                       *_no_held_out_args()], tmp_path / f"{name}.log")
    # Unsplit, the long line needed ~135 bytes per byte. Split, what remains is the line itself held by the reader
    # (a few copies of it, ~9 bytes per byte measured at this size); the bound is generous, and 8x below unsplit.
    assert peaks["long"] < peaks["short"] + 16 * size, {k: v / 2**20 for k, v in peaks.items()}


# ------------------------------------------------------------------------------------- 14. the Chinchilla budget


PRESETS = sorted(p for p in (REPO / "runs").iterdir() if (p / "train.json").is_file())


@pytest.mark.parametrize("preset", PRESETS, ids=[p.name for p in PRESETS])
def test_chinchilla_is_exactly_what_training_the_run_for_its_chinchilla_budget_reads(preset: Path):
    from nanopt.config import load_run
    from nanopt.data.budget import resolve_max_tokens
    from nanopt.model.flops import count_params

    tokens = resolve_max_tokens("chinchilla", preset)
    params = count_params(load_run(preset).model).total
    run = load_run(preset, {"train_tokens": 20 * params, "max_steps": None})  # trained to its Chinchilla budget
    samples = run.total_steps * run.train.global_batch_tokens // run.seq_len  # windows of seq_len + 1 it reads
    windows = (tokens - 1) // run.seq_len  # what the loader cuts from a split of this many tokens
    assert windows >= samples and run.total_tokens >= 20 * params  # enough for every step, none read twice
    assert (tokens - 2) // run.seq_len < samples  # and not one token more


TINY_MODEL = {"architecture": "llama", "vocab_size": 320, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 16}


def test_tokenize_chinchilla_then_train_that_run_to_completion(tmp_path: Path, cli_in_process):
    from nanopt.config import load_model_config, load_run
    from nanopt.model.flops import count_params

    corpus = write_jsonl(tmp_path / "corpus.jsonl", english_like_documents(300, seed=13))
    data, run = tmp_path / "data", tmp_path / "run"
    run.mkdir()
    (run / "model.json").write_text(json.dumps(TINY_MODEL))
    params = count_params(load_model_config(run / "model.json")).total
    train = {"data": str(data), "micro_batch_size": 64, "global_batch_tokens": 64 * 16 * 2,
             "train_tokens": 20 * params, "learning_rate": 3e-3, "warmup_steps": 5, "eval_interval": 0,
             "checkpoint_interval": 0, "log_interval": 50, "seed": 3}
    (run / "train.json").write_text(json.dumps(train))
    config = load_run(run)
    assert (20 * params) % config.train.global_batch_tokens != 0  # the budget is not whole batches: rounding matters
    result = cli_in_process("tokenize", corpus, "--out", data, "--vocab-size", "320", "--max-tokens", "chinchilla",
                            "--run", run, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["stopped_at_budget"]
    trained = cli_in_process("train", run, "--no-live")
    assert trained.returncode == 0, trained.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records if r["kind"] == "train") == config.total_steps
    assert not [r for r in records if r.get("event") == "data_repeats"]  # one pass: not a token short


def _no_held_out_args() -> list[str]:
    """Every document of these small corpora to train: a share no document's hash falls under (0 itself is refused
    on the command line, as it leaves a split empty)."""
    return ["--val-fraction", "1e-9", "--test-fraction", "1e-9"]
