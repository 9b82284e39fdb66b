"""How a corpus becomes a dataset: the tokenize settings, their defaults and their range checks.

Recorded in meta.json; the same source and settings give the same shards (nanopt.data.tokenize.pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from nanopt.config import MAX_MODEL_DIMENSION, TrainConfig, load_run
from nanopt.data.corpus.sources import Source
from nanopt.data.corpus.textcheck import DECODE_ERROR_POLICIES
from nanopt.data.tokenize.shuffle import MAX_SHUFFLE_BUFFER
from nanopt.data.tokenizers.tokenizer import MIN_VOCAB_SIZE, check_vocab_size
from nanopt.errors import ConfigError
from nanopt.parsing import INT64_MAX, check_option

BUILTIN_VOCAB_SIZE = 1024  # see TokenizeSettings.vocab_size
# Held out by default: documents whose hash falls below this share go to val (as many again to test) until the
# split has its target of tokens. So at most 10% of a small corpus leaves train (the built-in corpus: ~170k tokens
# each), and a large one fills a 1,048,576-token target from about its first 20M tokens: val and test
# then come from the start of the source, which a source sorted by topic or date should be shuffled for.
HELD_OUT_FRACTION = 0.05
# Without --run: what `nanopt eval` reads of test by default, and train.json's default eval_tokens.
DEFAULT_HELD_OUT_TOKENS = TrainConfig.eval_tokens
# Upper bounds of the options: far past what any corpus needs (batches are capped at 1 MiB of text anyway, and a
# BPE trained on a TiB of text would need many TiB of memory). A value past one is a typo.
MAX_BATCH_DOCUMENTS = 1 << 20
MAX_SAMPLE_MIB = 1 << 20


@dataclass(frozen=True)
class RunEval:
    """What the run given with --run evaluates: its eval_tokens, in windows of seq_len + 1 tokens at stride seq_len
    (nanopt.data.loaders.loader.eval_batches); a split shorter than one window cannot be evaluated at all."""

    run: str
    eval_tokens: int
    seq_len: int

    @property
    def window_tokens(self) -> int:
        return self.seq_len + 1

    def describe_window(self) -> str:
        return f"seq_len {self.seq_len} + 1 = {self.window_tokens:,}"


def run_eval(run_dir: Path | str | None) -> RunEval | None:
    """The evaluation settings of the run named by --run (ConfigError if it does not load), or None."""
    if run_dir is None:
        return None
    run = load_run(run_dir)
    return RunEval(str(run_dir), run.train.eval_tokens, run.seq_len)


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
    # Held out for val / test: documents whose hash falls below the fraction, in source order, until the split has
    # the tokens; see nanopt.data.tokenize.documents.SplitRule. Neither given: HELD_OUT_FRACTION and the run's
    # eval_tokens (DEFAULT_HELD_OUT_TOKENS without --run). A fraction given alone: no token target, every such document.
    val_fraction: float | None = None
    test_fraction: float | None = None
    val_tokens: int | None = None
    test_tokens: int | None = None
    shard_tokens: int = 100_000_000
    max_tokens: int | None = None  # stop once the train split has this many tokens
    sample: float | None = None  # keep each document with this probability (nanopt.data.tokenize.sampling); None: all
    sample_seed: int = 0  # which documents --sample keeps
    max_tokens_as_given: str | None = None  # --max-tokens as typed (e.g. "chinchilla"), to name it in messages
    run: str | None = None  # a run directory: sets the default val / test tokens; its eval batch is checked
    batch_size: int = 256  # documents (or pieces of long ones) per encode call
    on_decode_error: str = "replace"  # bytes that are not UTF-8 in local files: "replace" (U+FFFD) or "refuse"
    # Read the source through a shuffle buffer of this many documents (nanopt.data.tokenize.shuffle), drawn with
    # shuffle_seed (default 0): a sorted source gives unsorted splits and training order. None: source order.
    shuffle_buffer: int | None = None
    shuffle_seed: int | None = None
    force: bool = False

    def validate(self) -> None:
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is outside [0, 1)", f"e.g. {HELD_OUT_FRACTION}")
        _check_leaves_training(self.val_fraction or 0.0, self.test_fraction or 0.0)
        for name in ("val_tokens", "test_tokens"):
            check_option(f"--{name.replace('_', '-')}", getattr(self, name), 0, INT64_MAX,
                         "e.g. 1M (it defaults to the --run's eval_tokens, else 1,048,576)")
        if self.sample is not None and not 0.0 < self.sample <= 1.0:
            raise ConfigError(f"--sample {self.sample} is outside (0, 1]",
                              "the share of documents to keep, e.g. --sample 0.1 for one in ten")
        check_option("--sample-seed", self.sample_seed, 0, INT64_MAX, "e.g. --sample-seed 1 for another subset")
        check_option("--shard-tokens", self.shard_tokens, 1, INT64_MAX, "e.g. 100M tokens per shard file")
        check_option("--max-tokens", self.max_tokens, 1, INT64_MAX, "e.g. 2.5B, or leave it out for the whole corpus")
        check_option("--batch-size", self.batch_size, 1, MAX_BATCH_DOCUMENTS, "e.g. 256 documents per encode call")
        self._check_shuffle()
        # Given in MiB on the command line; rounded up here, so a library caller's few bytes still count as given.
        check_option("--tokenizer-sample-mb", -(-self.tokenizer_sample_bytes // (1 << 20)), 1, MAX_SAMPLE_MIB,
                     "e.g. 64 (MiB of training documents)")
        if self.vocab_size is not None:
            check_vocab_size(self.vocab_size)  # the trainer's own range, with its message
            # and no larger than any model nanopt builds can use (now, not after reading the corpus)
            check_option("--vocab-size", self.vocab_size, MIN_VOCAB_SIZE, MAX_MODEL_DIMENSION,
                         "e.g. 4096 for a CPU demo, 32768-65536 for a real corpus")
        if self.tokenizer is not None and self.vocab_size is not None:
            raise ConfigError("--vocab-size applies to a trained tokenizer, not to --tokenizer",
                              "give one of --tokenizer NAME and --vocab-size N")
        if self.on_decode_error not in DECODE_ERROR_POLICIES:
            raise ConfigError(f"--on-decode-error {self.on_decode_error!r} is not one of "
                              f"{', '.join(DECODE_ERROR_POLICIES)}",
                              "replace: such bytes become U+FFFD, counted in meta.json; refuse: stop at the first")
        if self.eos_token is not None and self.tokenizer is None:
            raise ConfigError("--eos-token applies to a loaded --tokenizer only",
                              "a trained tokenizer always ends documents with <|endoftext|>")

    def _check_shuffle(self) -> None:
        check_option("--shuffle-buffer", self.shuffle_buffer, 1, MAX_SHUFFLE_BUFFER,
                     "documents held at once, e.g. 100000 (memory: that many times the mean document)")
        check_option("--shuffle-seed", self.shuffle_seed, 0, INT64_MAX, "e.g. 0 or 1337")
        if self.shuffle_seed is not None and self.shuffle_buffer is None:
            raise ConfigError("--shuffle-seed without --shuffle-buffer: the seed draws the buffer's order",
                              "add --shuffle-buffer N (documents), e.g. --shuffle-buffer 100000")

    def resolved(self, source: Source, evaluation: RunEval | None = None) -> TokenizeSettings:
        """These settings with the defaults that depend on the source and the run filled in (as meta.json records
        them; a held-out split's tokens None there means no target)."""
        vocab = self.vocab_size
        if self.tokenizer is None and vocab is None:
            if source.kind != "builtin":
                raise ConfigError("no tokenizer given", "pass --tokenizer NAME_OR_PATH (e.g. gpt2) or --vocab-size "
                                  "N to train a byte-level BPE on this corpus (e.g. 32768)")
            vocab = BUILTIN_VOCAB_SIZE
        target = evaluation.eval_tokens if evaluation else DEFAULT_HELD_OUT_TOKENS
        val_fraction, val_tokens = _held_out(self.val_fraction, self.val_tokens, target)
        test_fraction, test_tokens = _held_out(self.test_fraction, self.test_tokens, target)
        _check_leaves_training(val_fraction, test_fraction)
        seed = (self.shuffle_seed or 0) if self.shuffle_buffer is not None else None
        return replace(self, vocab_size=vocab, val_fraction=val_fraction, val_tokens=val_tokens, shuffle_seed=seed,
                       test_fraction=test_fraction, test_tokens=test_tokens,
                       run=None if self.run is None else str(self.run))  # a library caller's Path, as JSON


def _held_out(fraction: float | None, tokens: int | None, default_tokens: int) -> tuple[float, int | None]:
    """A held-out split's (fraction, token target). A fraction given alone keeps its old meaning: that share of
    the documents, with no target."""
    if fraction is not None and tokens is None:
        return fraction, None
    return (HELD_OUT_FRACTION if fraction is None else fraction), (default_tokens if tokens is None else tokens)


# What each held-out split is for: why a command line that leaves it empty is refused.
HELD_OUT_USE = {"val": "nanopt train evaluates on val", "test": "nanopt eval scores test"}


def refuse_empty_held_out(val_fraction: float | None, test_fraction: float | None) -> None:
    """A fraction of 0 typed on the command line: that split would be empty, and train (val) or eval (test) would
    refuse the dataset only later. The library still takes 0, for a dataset that is all train (tests make one)."""
    for name, value in (("val", val_fraction), ("test", test_fraction)):
        if value == 0:
            raise ConfigError(f"--{name}-fraction 0 holds out no documents: {name} would be empty, and "
                              f"{HELD_OUT_USE[name]}", f"give a share above 0, e.g. {HELD_OUT_FRACTION} (the default)")


def _check_leaves_training(val_fraction: float, test_fraction: float) -> None:
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(f"--val-fraction {val_fraction} plus --test-fraction {test_fraction} leave nothing for "
                          "training", f"e.g. {HELD_OUT_FRACTION} each")
