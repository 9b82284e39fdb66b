"""The tokenize pipeline: a corpus source in, a dataset directory out (see nanopt.data.dataset for the format).

Documents stream through in batches: read and split-assigned on the main thread, encoded by the tokenizers
library's own thread pool (`encode_batch` releases the GIL, and two batches are kept in flight so both cores stay
busy while the main thread reads the next batch and writes the previous one), then appended to the split's
shards. Nothing grows with the corpus: at most a few batches are in memory, statistics are fixed-size.

Everything is written into a hidden staging directory beside the output and renamed into place at the end, with
meta.json written last, so an interrupted run never leaves a directory that looks like a complete dataset.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from nanopt.data.heap import fix_mmap_threshold
from nanopt.data.output import check_output, leftover_staging_dirs, staging_dir, write_meta
from nanopt.data.shards import SplitWriter, token_dtype
from nanopt.data.sources import Source, open_source
from nanopt.data.stats import SplitStats
from nanopt.data.tokenizer import NamedTokenizer, load_tokenizer, save_tokenizer, train_bpe
from nanopt.errors import ConfigError, DataError

SPLITS = ("train", "val", "test")
BUILTIN_VOCAB_SIZE = 1024  # see TokenizeSettings.vocab_size
BUILTIN_HELD_OUT_FRACTION = 0.05  # ~2x the demo eval (65536 tokens) in val and test
HELD_OUT_FRACTION = 0.005
# Batches are also capped by bytes: the tokenizer's work space is ~100 bytes per byte of text, so this bounds memory
# whatever the document sizes (8 MiB batches peaked at ~600 MiB on the built-in corpus, 1 MiB at ~230 MiB).
MAX_BATCH_BYTES = 1 << 20
ENCODE_AHEAD = 2  # batches being encoded while the main thread reads and writes


@dataclass
class TokenizeSettings:
    """How a corpus becomes a dataset. Recorded in meta.json; the same source and settings give the same shards."""

    config: str | None = None  # hub dataset configuration, e.g. "sample-10BT"
    split: str = "train"  # hub dataset split to read
    text_column: str = "text"
    sample_by: str = "document"  # text files: one document per file, paragraph or line
    tokenizer: str | None = None  # a Hugging Face name or local tokenizer.json; None trains a byte-level BPE
    # Trained BPE size. The built-in corpus defaults to 1024 for the CPU demo (hidden 128): a larger vocabulary puts
    # the demo's compute into the output head (at 4096 it was a third of the step) and leaves rare tokens
    # untrained; 1024 still gives ~2.6 bytes per token on Python source.
    vocab_size: int | None = None
    eos_token: str | None = None  # for loaded tokenizers whose end-of-text token cannot be detected
    tokenizer_sample_bytes: int = 64 << 20  # train the BPE on the first this-many bytes of training documents
    val_fraction: float | None = None  # None: 0.005 (0.05 for the small built-in corpus)
    test_fraction: float | None = None
    shard_tokens: int = 100_000_000
    max_tokens: int | None = None  # stop once the train split has this many tokens
    batch_size: int = 256  # documents per encode call
    force: bool = False

    def validate(self) -> None:
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is outside [0, 1)", "e.g. 0.005")
        if (self.val_fraction or 0.0) + (self.test_fraction or 0.0) >= 1.0:
            raise ConfigError("--val-fraction plus --test-fraction leave nothing for training", "e.g. 0.005 each")
        for name in ("shard_tokens", "batch_size", "tokenizer_sample_bytes", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}", "use a number > 0")
        if self.tokenizer is not None and self.vocab_size is not None:
            raise ConfigError("--vocab-size applies to a trained tokenizer, not to --tokenizer",
                              "give one of --tokenizer NAME and --vocab-size N")
        if self.eos_token is not None and self.tokenizer is None:
            raise ConfigError("--eos-token applies to a loaded --tokenizer only",
                              "a trained tokenizer always ends documents with <|endoftext|>")

    def resolved(self, source: Source) -> TokenizeSettings:
        """These settings with the defaults that depend on the source filled in (as recorded in meta.json)."""
        held_out = BUILTIN_HELD_OUT_FRACTION if source.kind == "builtin" else HELD_OUT_FRACTION
        vocab = self.vocab_size
        if self.tokenizer is None and vocab is None:
            if source.kind != "builtin":
                raise ConfigError("no tokenizer given", "pass --tokenizer NAME_OR_PATH (e.g. gpt2) or --vocab-size "
                                  "N to train a byte-level BPE on this corpus (e.g. 32768)")
            vocab = BUILTIN_VOCAB_SIZE
        return replace(self, vocab_size=vocab,
                       val_fraction=held_out if self.val_fraction is None else self.val_fraction,
                       test_fraction=held_out if self.test_fraction is None else self.test_fraction)


class ProgressReporter:
    """Receives progress; the CLI draws it with rich. `fraction` is None when the total is unknown (no ETA)."""

    def phase(self, description: str) -> None:
        pass

    def update(self, documents: int, tokens: int, fraction: float | None) -> None:
        pass


def build_dataset(out: Path | str, source: str | Source | None = None, *,
                  progress: ProgressReporter | None = None, **settings: Any) -> dict[str, Any]:
    """Tokenize `source` (None: the built-in corpus; a path, glob or hub name; or a Source) into dataset dir `out`.

    Keyword settings are the fields of TokenizeSettings. Returns the summary (also what `--json` prints).
    """
    given = TokenizeSettings(**settings)
    given.validate()
    out = Path(out)
    check_output(out, given.force)
    src = source if hasattr(source, "texts") else open_source(source, given.config, given.split,
                                                                given.text_column, given.sample_by)
    opts = given.resolved(src)
    reporter = progress or ProgressReporter()
    fix_mmap_threshold()
    started = time.monotonic()
    with staging_dir(out) as root:
        named = _prepare_tokenizer(src, opts, reporter)
        run = _Run(src, named, root, opts, reporter)
        run.tokenize()
        save_tokenizer(named, root / "tokenizer.json")
        seconds = time.monotonic() - started
        meta = write_meta(root, named, run.split_dicts(), src.describe(), _settings_record(opts), run.extra(),
                          seconds)
    return _summary(out, meta, seconds, run)


def _prepare_tokenizer(src: Source, opts: TokenizeSettings, reporter: ProgressReporter) -> NamedTokenizer:
    if opts.tokenizer is not None:
        reporter.phase(f"loading tokenizer {opts.tokenizer}")
        return load_tokenizer(opts.tokenizer, opts.eos_token)
    reporter.phase(f"training a {opts.vocab_size}-token byte-level BPE")
    return train_bpe(_tokenizer_sample(src, opts, reporter), opts.vocab_size)


def _tokenizer_sample(src: Source, opts: TokenizeSettings, reporter: ProgressReporter) -> Iterator[str]:
    """Training-split documents from the start of the source, up to the byte bound (val/test stay unseen)."""
    val, test = opts.val_fraction, opts.test_fraction
    taken = documents = 0
    known = src.size_hint().bytes
    expected = min(opts.tokenizer_sample_bytes, known) if known else opts.tokenizer_sample_bytes
    for raw in src.texts():
        if _is_empty(raw):
            continue
        text, data = _clean(raw)
        if split_of(data, val, test) != "train":
            continue
        yield text
        taken += len(data)
        documents += 1
        reporter.update(documents, 0, min(1.0, taken / expected))
        if taken >= opts.tokenizer_sample_bytes:
            return


def split_of(data: bytes, val_fraction: float, test_fraction: float) -> str:
    """The split of a document: its BLAKE2b hash as a number in [0, 1) against the fractions.

    Depends on the text alone, so it is deterministic, independent of order and batch size, and identical copies
    of a document always land in the same split (no duplicate leaks from train into val).
    """
    position = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2.0**64
    if position < val_fraction:
        return "val"
    return "test" if position < val_fraction + test_fraction else "train"


def _is_empty(text: str) -> bool:
    return not text or text.isspace()


def _clean(text: str) -> tuple[str, bytes]:
    """The text and its UTF-8 bytes. A Python string can hold lone surrogates (e.g. decoded with "surrogateescape"),
    which can be neither encoded nor tokenized; they become U+FFFD, as undecodable bytes in files do."""
    try:
        return text, text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
        return text, text.encode("utf-8")


@dataclass
class _Batch:
    texts: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)


class _Run:
    """One pass over the source: batches in, shards and statistics out, stopping at the token budget."""

    def __init__(self, src: Source, named: NamedTokenizer, root: Path, opts: TokenizeSettings,
                 reporter: ProgressReporter) -> None:
        self.src, self.named, self.opts, self.reporter = src, named, opts, reporter
        self.dtype = token_dtype(named.vocab_size)
        self.writers = {s: SplitWriter(root, s, self.dtype, opts.shard_tokens) for s in SPLITS}
        self.stats = {s: SplitStats() for s in SPLITS}
        self.shards: dict[str, list] = {}
        self.skipped_empty = self.read_documents = self.read_bytes = 0
        self.stopped_at_budget = False
        self.size = src.size_hint()
        self.seconds = 0.0

    def tokenize(self) -> None:
        started = time.monotonic()
        try:
            self.reporter.phase("tokenizing")
            for batch, ids in _encode_ahead(self._batches(), self.named.tokenizer):
                if self._write(batch, ids):
                    self.stopped_at_budget = True
                    break
            self.shards = {split: writer.close() for split, writer in self.writers.items()}
            self.seconds = time.monotonic() - started
        finally:
            for writer in self.writers.values():
                writer.abort()
        if sum(s.documents for s in self.stats.values()) == 0:
            raise DataError(f"the source has no documents ({self.skipped_empty} empty ones skipped)",
                            "check the source path or name, --split and --text-column")

    def _batches(self) -> Iterator[_Batch]:
        val, test = self.opts.val_fraction, self.opts.test_fraction
        batch, batch_bytes = _Batch(), 0
        for raw in self.src.texts():
            self.read_documents += 1
            if _is_empty(raw):
                self.skipped_empty += 1
                continue
            text, data = _clean(raw)
            batch.texts.append(text)
            batch.splits.append(split_of(data, val, test))
            batch.nbytes.append(len(data))
            batch_bytes += len(data)
            self.read_bytes += len(data)
            if len(batch.texts) >= self.opts.batch_size or batch_bytes >= MAX_BATCH_BYTES:
                yield batch
                batch, batch_bytes = _Batch(), 0
        if batch.texts:
            yield batch

    def _write(self, batch: _Batch, ids: list[list[int]]) -> bool:
        """Append a batch to the shards; True when the train budget is reached (the batch is cut there)."""
        cut = self._budget_cut(batch, ids)
        count = len(ids) if cut is None else cut[0] + 1
        for split in SPLITS:
            members = [i for i in range(count) if batch.splits[i] == split]
            if members:
                documents = [ids[i] for i in members]
                tokens = self._concatenate(documents, drop_last_eos=cut is not None and cut[1] and split == "train")
                self.writers[split].write(tokens)
                self.stats[split].add([len(d) for d in documents], [batch.nbytes[i] for i in members], tokens)
        self._report()
        return cut is not None

    def _budget_cut(self, batch: _Batch, ids: list[list[int]]) -> tuple[int, bool] | None:
        """(index of the train document that reaches --max-tokens, whether it was shortened to end exactly there
        without its EOS), or None while the budget is not reached."""
        budget = self.opts.max_tokens
        if budget is None:
            return None
        train_tokens = self.stats["train"].tokens
        for i, split in enumerate(batch.splits):
            if split != "train":
                continue
            train_tokens += len(ids[i]) + 1
            overshoot = train_tokens - budget
            if overshoot == 0:
                return i, False
            if overshoot > 0:
                ids[i] = ids[i][:len(ids[i]) + 1 - overshoot]
                text = self.named.tokenizer.decode(ids[i], skip_special_tokens=False)
                batch.nbytes[i] = len(_clean(text)[1])
                return i, True
        return None

    def _concatenate(self, documents: list[list[int]], drop_last_eos: bool) -> np.ndarray:
        """One token array: each document followed by EOS, except a last document cut at the budget. Filled in
        place, without a batch-sized Python list (large short-lived allocations fragment the heap)."""
        total = sum(len(doc) + 1 for doc in documents) - drop_last_eos
        tokens = np.empty(total, dtype=self.dtype)
        position = 0
        for doc in documents:
            tokens[position:position + len(doc)] = doc
            position += len(doc)
            if position < total:
                tokens[position] = self.named.eos_id
                position += 1
        return tokens

    def _report(self) -> None:
        fractions = []
        if self.opts.max_tokens:
            fractions.append(self.stats["train"].tokens / self.opts.max_tokens)
        if self.size.bytes:
            fractions.append(self.read_bytes / self.size.bytes)
        if self.size.documents:
            fractions.append(self.read_documents / self.size.documents)
        documents = sum(s.documents for s in self.stats.values())
        tokens = sum(s.tokens for s in self.stats.values())
        self.reporter.update(documents, tokens, min(1.0, max(fractions)) if fractions else None)

    def split_dicts(self) -> dict[str, dict[str, Any]]:
        return {split: {**self.stats[split].to_dict(), "shards": [s.to_dict() for s in self.shards[split]]}
                for split in SPLITS}

    def extra(self) -> dict[str, Any]:
        return {"documents_read": self.read_documents, "empty_documents_skipped": self.skipped_empty,
                "stopped_at_budget": self.stopped_at_budget}


def _encode_ahead(batches: Iterator[_Batch], tokenizer: Any) -> Iterator[tuple[_Batch, list[list[int]]]]:
    """Yield (batch, token ids per document) in order while the next batches encode on worker threads."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no character offsets: faster

    def encode_ids(texts: list[str]) -> list[list[int]]:
        # Taking the ids here frees the Encoding objects (~90 bytes per token) as soon as possible, and moves that
        # work off the main thread, which meanwhile reads and hashes the next batch.
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    with ThreadPoolExecutor(max_workers=ENCODE_AHEAD, thread_name_prefix="nanopt-encode") as pool:
        pending: deque = deque()
        try:
            for batch in batches:
                pending.append((batch, pool.submit(encode_ids, batch.texts)))
                if len(pending) > ENCODE_AHEAD:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            for _, future in pending:
                future.cancel()


def _settings_record(opts: TokenizeSettings) -> dict[str, Any]:
    record = {k: v for k, v in asdict(opts).items() if k != "force"}
    return {**record, "split_rule": "blake2b-64 of the UTF-8 text"}


def _summary(out: Path, meta: dict[str, Any], seconds: float, run: _Run) -> dict[str, Any]:
    splits = {name: {k: v for k, v in info.items() if k != "shards"} | {"shards": len(info["shards"])}
              for name, info in meta["splits"].items()}
    tokens = sum(s["tokens"] for s in splits.values())
    documents = sum(s["documents"] for s in splits.values())
    warnings = [f"split '{name}' is empty: raise --{name}-fraction or give more documents (text files: "
                f"--sample-by paragraph)" for name in ("val", "test") if not splits[name]["documents"]
                and meta["settings"][f"{name}_fraction"] > 0]
    warnings += [f"leftover {p} from an interrupted run: delete it" for p in leftover_staging_dirs(out)]
    encode_seconds = max(run.seconds, 1e-9)
    return {"out": str(out), "tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"],
            "dtype": meta["dtype"], "splits": splits, "documents": documents, "tokens": tokens,
            "seconds": round(seconds, 3), "tokenize_seconds": round(run.seconds, 3),
            "tokens_per_second": round(tokens / encode_seconds, 1),
            "documents_per_second": round(documents / encode_seconds, 1), **run.extra(), "warnings": warnings}
