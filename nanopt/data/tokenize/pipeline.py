"""The tokenize pipeline: a corpus source in, a dataset directory out (see nanopt.data.dataset for the format).

Local files are checked first (nanopt.data.corpus.textcheck.check_text_file): a file that is not text is refused, bytes
that are not UTF-8 are counted per file, warned about and recorded in meta.json, or refused with --on-decode-error
refuse, before anything is written.

Documents stream through in batches: read and hashed on the main thread, encoded by the tokenizers
library's own thread pool (`encode_batch` releases the GIL, and two batches are kept in flight so both cores stay
busy while the main thread reads the next batch and writes the previous one), then appended to the split's
shards. Each document's split is settled in source order as its ids are written
(nanopt.data.tokenize.documents.SplitRule: its hash holds it out for val or test while that split is short of its target
of tokens), so the shards do not depend on the batch size. A document longer than MAX_PIECE_CHARS is encoded as several
pieces, cut where the ids do not change (nanopt.data.tokenizers.tokenizer.piece_ends), so the tokenizer's memory does
not grow with the longest document either. Nothing grows with the corpus: at most a few batches are in memory,
statistics are fixed-size but for 8 bytes per document of 65536 tokens or more (nanopt.data.tokenize.stats), and the
split rule keeps the hashes of held-out documents only (bounded by the held-out targets).

Everything is written into a hidden staging directory beside the output and renamed into place at the end, with
meta.json written last, so an interrupted run never leaves a directory that looks like a complete dataset.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nanopt.data.corpus.sources import Source, open_source
from nanopt.data.corpus.textcheck import check_text_file
from nanopt.data.output import check_output, staging_dir, write_meta
from nanopt.data.shards import SplitWriter, token_dtype
from nanopt.data.tokenize.documents import HELD_OUT, SplitRule, clean, document_pieces, is_empty
from nanopt.data.tokenize.heap import fix_mmap_threshold
from nanopt.data.tokenize.sampling import SampledSource
from nanopt.data.tokenize.settings import TokenizeSettings, run_eval
from nanopt.data.tokenize.shuffle import ShuffledSource
from nanopt.data.tokenize.stats import SplitStats
from nanopt.data.tokenize.summary import summarize
from nanopt.data.tokenizers.tokenizer import (
    NamedTokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from nanopt.errors import DataError

SPLITS = ("train", "val", "test")
# Batches are also capped by bytes: the tokenizer's work space is ~100 bytes per byte of text, so this bounds memory
# whatever the document sizes (8 MiB batches peaked at ~600 MiB on the built-in corpus, 1 MiB at ~230 MiB).
MAX_BATCH_BYTES = 1 << 20
ENCODE_AHEAD = 2  # batches being encoded while the main thread reads and writes
MAX_DECODE_WARNINGS = 20  # files warned about one by one; meta.json has them all


class ProgressReporter:
    """Receives progress and warnings; the CLI draws them with rich. `fraction` is None when the total is unknown
    (no ETA)."""

    def phase(self, description: str) -> None:
        pass

    def update(self, documents: int, tokens: int, fraction: float | None) -> None:
        pass

    def warn(self, message: str) -> None:
        """Something the user must know while the run goes on (the summary repeats it in its warnings)."""


def build_dataset(out: Path | str, source: str | Source | None = None, *,
                  progress: ProgressReporter | None = None, **settings: Any) -> dict[str, Any]:
    """Tokenize `source` (None: the built-in corpus; a path, glob or hub name; or a Source) into dataset dir `out`.

    Keyword settings are the fields of TokenizeSettings. Returns the summary (also what `--json` prints).
    """
    given = TokenizeSettings(**settings)
    given.validate()
    out = Path(out)
    check_output(out, given.force)
    evaluation = run_eval(given.run)
    src = source if hasattr(source, "texts") else open_source(source, given.config, given.split,
                                                                given.text_column, given.sample_by)
    if given.sample is not None and given.sample < 1.0:
        src = SampledSource(src, given.sample, given.sample_seed)
    opts = given.resolved(src, evaluation)
    if opts.shuffle_buffer is not None:  # the tokenizer's sample, the splits and the shards all see this order
        src = ShuffledSource(src, opts.shuffle_buffer, opts.shuffle_seed)
    reporter = progress or ProgressReporter()
    fix_mmap_threshold()
    started = time.monotonic()
    undecodable = _check_text_files(src, opts, reporter)
    with staging_dir(out) as root:
        named = _prepare_tokenizer(src, opts, reporter)
        run = _Run(src, named, root, opts, reporter)
        run.tokenize()
        save_tokenizer(named, root / "tokenizer.json")
        seconds = time.monotonic() - started
        meta = write_meta(root, named, run.split_dicts(), _source_record(src, undecodable), _settings_record(opts),
                          run.extra(), seconds)
    return summarize(out, meta, seconds, run.seconds, run.extra(), evaluation)


def _check_text_files(src: Source, opts: TokenizeSettings, reporter: ProgressReporter) -> dict[str, int] | None:
    """Undecodable bytes per file of a source of local files (those with any), or None for other sources.

    Raises DataError for a file that is not text, and with --on-decode-error refuse at the first undecodable byte:
    before anything is written or trained.
    """
    files = src.text_files() if hasattr(src, "text_files") else []  # optional for sources of in-memory text
    if not files:
        return None
    reporter.phase(f"checking that {len(files):,} files are UTF-8 text")
    counts: dict[str, int] = {}
    for done, file in enumerate(files, 1):
        count = check_text_file(file, refuse=opts.on_decode_error == "refuse")
        if count:
            counts[file.name] = count
            _warn_undecodable(reporter, file.name, count, len(counts))
        reporter.update(done, 0, done / len(files))
    return counts


def _warn_undecodable(reporter: ProgressReporter, name: str, count: int, files_so_far: int) -> None:
    if files_so_far <= MAX_DECODE_WARNINGS:
        reporter.warn(f"{name}: {count:,} bytes that are not UTF-8 will be replaced with U+FFFD "
                      "(--on-decode-error refuse stops instead)")
    if files_so_far == MAX_DECODE_WARNINGS:
        reporter.warn("further files with bytes that are not UTF-8 are not listed here: meta.json has every count "
                      "(source.undecodable_bytes_by_file)")


def _source_record(src: Source, undecodable: dict[str, int] | None) -> dict[str, Any]:
    """The source as meta.json records it; for local files with the bytes that were not UTF-8, per file."""
    if undecodable is None:
        return src.describe()
    return {**src.describe(), "undecodable_bytes": sum(undecodable.values()),
            "undecodable_bytes_by_file": undecodable}


def _prepare_tokenizer(src: Source, opts: TokenizeSettings, reporter: ProgressReporter) -> NamedTokenizer:
    if opts.tokenizer is not None:
        reporter.phase(f"loading tokenizer {opts.tokenizer}")
        return load_tokenizer(opts.tokenizer, opts.eos_token)
    reporter.phase(f"training a {opts.vocab_size}-token byte-level BPE")
    return train_bpe(_tokenizer_sample(src, opts, reporter), opts.vocab_size)


def _tokenizer_sample(src: Source, opts: TokenizeSettings, reporter: ProgressReporter) -> Iterator[str]:
    """Training-split documents from the start of the source, up to the byte bound (val/test stay unseen). Long
    documents come in the pieces they are encoded in: the trainer's memory, too, grows with what it gets at once."""
    rule = _split_rule(opts)
    taken = documents = 0
    known = src.size_hint().bytes
    expected = min(opts.tokenizer_sample_bytes, known) if known else opts.tokenizer_sample_bytes
    for raw in src.texts():
        if is_empty(raw):
            continue
        key, pieces = document_pieces(raw)
        if rule.held_out_for(key) != "train":  # held out whether or not its split will still take it
            continue
        documents += 1
        for text, nbytes in pieces:
            yield text
            taken += nbytes
            reporter.update(documents, 0, min(1.0, taken / expected))
            if taken >= opts.tokenizer_sample_bytes:
                return


@dataclass
class _Batch:
    """Pieces to encode together: whole documents, or consecutive pieces of a long one (last: it ends there)."""

    texts: list[str] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # the document's (nanopt.data.tokenize.documents.document_key)
    nbytes: list[int] = field(default_factory=list)
    last: list[bool] = field(default_factory=list)


@dataclass
class _Routed:
    """Where the pieces of a batch go: their split (None: dropped, train past the budget), whether an EOS follows
    each, and whether each ends its document in the statistics (a document cut at the budget ends there)."""

    splits: list[str | None] = field(default_factory=list)
    eos: list[bool] = field(default_factory=list)
    ends: list[bool] = field(default_factory=list)


class _Run:
    """One pass over the source: batches in, shards and statistics out. Train stops at the token budget; reading
    goes on while a held-out split with a target is short of it (nanopt.data.tokenize.documents.SplitRule)."""

    def __init__(self, src: Source, named: NamedTokenizer, root: Path, opts: TokenizeSettings,
                 reporter: ProgressReporter) -> None:
        self.src, self.named, self.opts, self.reporter = src, named, opts, reporter
        self.dtype = token_dtype(named.vocab_size)
        self.writers = {s: SplitWriter(root, s, self.dtype, opts.shard_tokens) for s in SPLITS}
        self.stats = {s: SplitStats() for s in SPLITS}
        self.rule = _split_rule(opts)
        self.routed_tokens = dict.fromkeys(SPLITS, 0)  # as written, EOS included; ahead of stats within a batch
        self.open_split: str | None = None  # the split of a long document whose last piece is still to come
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
                self._write(batch, ids)
                if self._complete():
                    break
            self.shards = {split: writer.close() for split, writer in self.writers.items()}
            self.seconds = time.monotonic() - started
        finally:
            for writer in self.writers.values():
                writer.abort()
        if sum(s.documents for s in self.stats.values()) == 0:
            raise DataError(f"the source has no documents ({self.skipped_empty} empty ones skipped)",
                            "check the source path or name, --split and --text-column")

    def _complete(self) -> bool:
        """Train has its budget and no held-out split wants more, nor has a document half written (a long one is
        written in pieces, and a held-out document joins whole)."""
        return (self.stopped_at_budget and self.open_split not in HELD_OUT
                and not self.rule.filling(self.routed_tokens))

    def _batches(self) -> Iterator[_Batch]:
        batch, batch_bytes = _Batch(), 0
        for raw in self.src.texts():
            if self._complete():  # the encoder may be a few batches behind: no need to read on meanwhile
                break
            self.read_documents += 1
            if is_empty(raw):
                self.skipped_empty += 1
                continue
            key, pieces = document_pieces(raw)
            if self.stopped_at_budget and self.rule.held_out_for(key) == "train":
                continue  # past the budget only held-out documents are still taken: do not encode the others
            for number, (text, nbytes) in enumerate(pieces, 1):
                batch.texts.append(text)
                batch.keys.append(key)
                batch.nbytes.append(nbytes)
                batch.last.append(number == len(pieces))
                batch_bytes += nbytes
                self.read_bytes += nbytes
                if len(batch.texts) >= self.opts.batch_size or batch_bytes >= MAX_BATCH_BYTES:
                    yield batch
                    batch, batch_bytes = _Batch(), 0
        if batch.texts:
            yield batch

    def _write(self, batch: _Batch, ids: list[list[int]]) -> None:
        """Append a batch to the shards of the splits its documents go to."""
        reached_before = self.stopped_at_budget
        routed = self._route(batch, ids)
        if self.stopped_at_budget and not reached_before and not self._complete():
            self.reporter.phase("train has its --max-tokens: reading on to fill val and test")
        for split in SPLITS:
            members = [i for i, to in enumerate(routed.splits) if to == split]
            if members:
                tokens = self._concatenate([ids[i] for i in members], [routed.eos[i] for i in members])
                self.writers[split].write(tokens)
                self.stats[split].add([len(ids[i]) for i in members], [batch.nbytes[i] for i in members],
                                      [routed.ends[i] for i in members], tokens)
        self._report()

    def _route(self, batch: _Batch, ids: list[list[int]]) -> _Routed:
        """Each piece's split, in source order: a document's split is settled at its first piece from the tokens
        routed before it, so the result does not depend on how documents are batched."""
        routed = _Routed()
        for i, last in enumerate(batch.last):
            if self.open_split is None:
                self.open_split = self.rule.split_of_next(batch.keys[i], self.routed_tokens, self.stopped_at_budget)
            split, eos, ends = self.open_split, last, last
            if split == "train":
                if self.stopped_at_budget:
                    split = None
                else:
                    eos, ends = self._train_piece(batch, ids, i)
            if split is not None:
                self.routed_tokens[split] += len(ids[i]) + eos
            routed.splits.append(split)
            routed.eos.append(eos)
            routed.ends.append(ends)
            if last:
                self.open_split = None
        return routed

    def _train_piece(self, batch: _Batch, ids: list[list[int]], i: int) -> tuple[bool, bool]:
        """(whether the EOS follows, whether the document ends here) for a train piece. The piece at which train
        reaches --max-tokens is shortened to end exactly there (the EOS goes first, then tokens), and ends its
        document; stopped_at_budget is set."""
        last, budget = batch.last[i], self.opts.max_tokens
        overshoot = (self.routed_tokens["train"] + len(ids[i]) + last - budget) if budget is not None else -1
        if overshoot < 0:
            return last, last
        self.stopped_at_budget = True
        if overshoot == 0:
            return last, True
        keep = len(ids[i]) + last - overshoot
        if keep < len(ids[i]):
            ids[i] = ids[i][:keep]
            text = self.named.tokenizer.decode(ids[i], skip_special_tokens=False)
            batch.nbytes[i] = len(clean(text)[1])
        return False, True

    def _concatenate(self, pieces: list[list[int]], eos: list[bool]) -> np.ndarray:
        """One token array: each piece, followed by EOS where eos says (the end of its document). Filled in place,
        without a batch-sized Python list (large short-lived allocations fragment the heap)."""
        tokens = np.empty(sum(len(piece) for piece in pieces) + sum(eos), dtype=self.dtype)
        position = 0
        for piece, ends_with_eos in zip(pieces, eos, strict=True):
            tokens[position:position + len(piece)] = piece
            position += len(piece)
            if ends_with_eos:
                tokens[position] = self.named.eos_id
                position += 1
        return tokens

    def _report(self) -> None:
        fractions = [self._budget_progress()] if self.opts.max_tokens else []
        if self.size.bytes:
            fractions.append(self.read_bytes / self.size.bytes)
        if self.size.documents:
            fractions.append(self.read_documents / self.size.documents)
        documents = sum(s.documents for s in self.stats.values())
        tokens = sum(s.tokens for s in self.stats.values())
        self.reporter.update(documents, tokens, min(1.0, max(fractions)) if fractions else None)

    def _budget_progress(self) -> float:
        """Train's share of --max-tokens; past it, how full the emptiest held-out split with a target is."""
        if not self.stopped_at_budget:
            return self.stats["train"].tokens / self.opts.max_tokens
        return min((self.routed_tokens[s] / self.rule.target(s) for s in self.rule.targeted()), default=1.0)

    def split_dicts(self) -> dict[str, dict[str, Any]]:
        return {split: {**self.stats[split].to_dict(), "shards": [s.to_dict() for s in self.shards[split]]}
                for split in SPLITS}

    def extra(self) -> dict[str, Any]:
        return {"documents_read": self.read_documents, "empty_documents_skipped": self.skipped_empty,
                "stopped_at_budget": self.stopped_at_budget}


def _split_rule(opts: TokenizeSettings) -> SplitRule:
    """The split rule of resolved settings (TokenizeSettings.resolved)."""
    return SplitRule(opts.val_fraction, opts.test_fraction, opts.val_tokens, opts.test_tokens)


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


SPLIT_RULE = ("blake2b-64 of the UTF-8 text: below val_fraction holds a document out for val, the next test_fraction "
              "for test; held-out documents join their split in source order while it has fewer than val_tokens / "
              "test_tokens tokens (null: no limit), then train; a copy joins where its first copy did")


def _settings_record(opts: TokenizeSettings) -> dict[str, Any]:
    record = {k: v for k, v in asdict(opts).items() if k != "force"}
    return {**record, "split_rule": SPLIT_RULE}
