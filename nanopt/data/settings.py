"""How a corpus becomes a dataset: the tokenize settings, their defaults and their range checks.

Recorded in meta.json; the same source and settings give the same shards (nanopt.data.pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanopt.config import MAX_MODEL_DIMENSION
from nanopt.data.sources import Source
from nanopt.data.textcheck import DECODE_ERROR_POLICIES
from nanopt.data.tokenizer import MIN_VOCAB_SIZE, check_vocab_size
from nanopt.errors import ConfigError
from nanopt.parsing import INT64_MAX, check_option

BUILTIN_VOCAB_SIZE = 1024  # see TokenizeSettings.vocab_size
BUILTIN_HELD_OUT_FRACTION = 0.05  # ~2x the demo eval (65536 tokens) in val and test
HELD_OUT_FRACTION = 0.005
# Upper bounds of the options: far past what any corpus needs (batches are capped at 1 MiB of text anyway, and a
# BPE trained on a TiB of text would need many TiB of memory). A value past one is a typo.
MAX_BATCH_DOCUMENTS = 1 << 20
MAX_SAMPLE_MIB = 1 << 20


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
    batch_size: int = 256  # documents (or pieces of long ones) per encode call
    on_decode_error: str = "replace"  # bytes that are not UTF-8 in local files: "replace" (U+FFFD) or "refuse"
    force: bool = False

    def validate(self) -> None:
        for name in ("val_fraction", "test_fraction"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} {value} is outside [0, 1)", "e.g. 0.005")
        if (self.val_fraction or 0.0) + (self.test_fraction or 0.0) >= 1.0:
            raise ConfigError("--val-fraction plus --test-fraction leave nothing for training", "e.g. 0.005 each")
        check_option("--shard-tokens", self.shard_tokens, 1, INT64_MAX, "e.g. 100M tokens per shard file")
        check_option("--max-tokens", self.max_tokens, 1, INT64_MAX, "e.g. 2.5B, or leave it out for the whole corpus")
        check_option("--batch-size", self.batch_size, 1, MAX_BATCH_DOCUMENTS, "e.g. 256 documents per encode call")
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
