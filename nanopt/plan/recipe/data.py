"""What a plan reads of its dataset (`--data`): the vocabulary the model needs and the size of each split, and the
refusal of a dataset too small for the budget: more passes over its train split than --max-epochs, or a val split
without one sequence to evaluate."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanopt.errors import ConfigError
from nanopt.untrusted_text import shell_word

VOCAB_MULTIPLE = 64  # embedding rows padded to a multiple of 64: tensor-core friendly, as nanopt suggests elsewhere


@dataclass(frozen=True)
class DataSplits:
    vocab_size: int  # the model's: the dataset's token ids, padded to VOCAB_MULTIPLE
    train_tokens: int
    val_tokens: int
    test_tokens: int


def read_splits(path: Path) -> DataSplits:
    """The dataset's meta.json, checked as training checks it (nanopt.data.dataset), its shards not hashed."""
    from nanopt.data.dataset import TokenDataset

    dataset = TokenDataset.open(path, verify_up_to_bytes=0)
    sizes = {split: dataset.split_tokens(split) if split in dataset.splits else 0 for split in ("train", "val", "test")}
    vocab = -(-dataset.id_limit // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return DataSplits(vocab, sizes["train"], sizes["val"], sizes["test"])


def check_epochs(splits: DataSplits, path: Path, tokens: int, max_epochs: float, seq_len: int,
                 budget_at: Callable[[float], str | None]) -> None:
    """ConfigError when the run would read the train split more than `max_epochs` times, or the val split cannot
    hold one sequence. `budget_at(factor)`: the budget that buys `factor` x the plan's compute (tokens grow as the
    square root of the compute under a compute-optimal split: N and D both scale with sqrt(C)), None when no budget
    that small can be planned."""
    where = f"--data {shell_word(path)}"
    if splits.val_tokens < seq_len + 1:
        raise ConfigError(f"{where}: its val split holds {splits.val_tokens:,} tokens, fewer than one sequence of "
                          f"{seq_len + 1:,} to evaluate on",
                          f"tokenize it again with a larger val split: `nanopt tokenize SOURCE --out "
                          f"{shell_word(path)} --val-tokens {max(4 * seq_len, 65536)} --force`")
    epochs = tokens / max(splits.train_tokens, 1)
    if epochs <= max_epochs:
        return
    lower = budget_at((max_epochs * splits.train_tokens / tokens) ** 2)
    raise ConfigError(f"{where}: its train split holds {splits.train_tokens:,} tokens and this budget trains on "
                      f"{tokens:,}: {epochs:.1f} epochs, more than --max-epochs {max_epochs:g}",
                      f"tokenize more text into it (at least {math.ceil(tokens / max_epochs) + 1:,} train tokens), "
                      + (f"lower --budget to about {lower}, " if lower else "")
                      + f"or allow it with --max-epochs {math.ceil(epochs)}")
