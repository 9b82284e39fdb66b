"""A byte-level BPE tokenizer from GPT-2's original files, vocab.json + merges.txt, as transformers builds it.

transformers loads such a directory (GPT2Tokenizer / GPT2TokenizerFast) into this `tokenizers` pipeline: a BPE
model over the vocabulary and merges (no subword prefix or word suffix, no unknown token), a byte-level
pre-tokenizer (with a leading space only when tokenizer_config.json sets `add_prefix_space`) and decoder. Its
special tokens are those tokenizer_config.json, special_tokens_map.json and added_tokens.json name, and GPT-2's
default `<|endoftext|>` (its bos, eos and unk) when the vocabulary has it. The result is an ordinary tokenizers
Tokenizer, saved into the dataset as tokenizer.json like any other.

Every file is read bounded (nanopt.parsing) and parsed as data: nothing in the directory runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.errors import DataError
from nanopt.parsing import read_capped, read_json

VOCAB_FILE, MERGES_FILE = "vocab.json", "merges.txt"
GPT2_DEFAULT_SPECIAL = "<|endoftext|>"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_MAX_BYTES = 256 << 20  # as a tokenizer.json: a guard against a stranger's huge file, far past any real one
_HINT = "pass a directory with GPT-2's vocab.json and merges.txt (as transformers saves them), or a tokenizer.json"


def has_bpe_files(directory: Path) -> bool:
    return (directory / VOCAB_FILE).is_file() and (directory / MERGES_FILE).is_file()


def read_bpe_files(directory: Path) -> Any:
    """The tokenizers.Tokenizer that transformers builds from `directory`'s vocab.json and merges.txt; DataError in
    one line naming the file for anything it cannot read."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = _vocab(directory / VOCAB_FILE)
    merges = _merges(directory / MERGES_FILE)
    settings = _json_or_empty(directory / "tokenizer_config.json")
    try:
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # the library raises a bare Exception for a merge of unknown tokens
        raise DataError(f"{directory / MERGES_FILE}: does not fit {VOCAB_FILE} ({exc})", _HINT) from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=settings.get("add_prefix_space") is True)
    tokenizer.decoder = decoders.ByteLevel()
    added = _json_or_empty(directory / "added_tokens.json")
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in sorted(added, key=added.get)
                          if isinstance(token, str) and token not in vocab])
    specials = _special_tokens(settings, _json_or_empty(directory / "special_tokens_map.json"), vocab)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    return tokenizer


def _vocab(path: Path) -> dict[str, int]:
    vocab = read_json(path, error=DataError, hint=_HINT, max_bytes=_MAX_BYTES)
    if not isinstance(vocab, dict) or not vocab or not all(
            isinstance(token, str) and isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32
            for token, i in vocab.items()):
        raise DataError(f"{path}: not a vocabulary (an object of token: id, ids from 0 to 2^32 - 1)", _HINT)
    return vocab


def _merges(path: Path) -> list[tuple[str, str]]:
    try:
        text = read_capped(path, _MAX_BYTES, DataError, _HINT, "merges file").decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text", _HINT) from None
    merges = []
    for number, line in enumerate(text.splitlines(), 1):
        if (number == 1 and line.startswith("#version")) or not line:
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise DataError(f"{path}: line {number} is not two tokens separated by a space", _HINT)
        merges.append((pair[0], pair[1]))
    return merges


def _json_or_empty(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    found = read_json(path, error=DataError, hint=_HINT)
    if not isinstance(found, dict):
        raise DataError(f"{path}: not a JSON object", _HINT)
    return found


def _special_tokens(settings: dict[str, Any], special_map: dict[str, Any], vocab: dict[str, int]) -> list[str]:
    """The special tokens the two files name; GPT-2's `<|endoftext|>` (its default bos, eos and unk) unless they
    name another eos."""
    named: list[str] = []
    for source in (special_map, settings):
        named.extend(_content(source.get(key)) for key in _SPECIAL_KEYS)
        extra = source.get("additional_special_tokens")
        if isinstance(extra, list):
            named.extend(_content(token) for token in extra)
    if not any(_content(source.get("eos_token")) for source in (special_map, settings)) and \
            GPT2_DEFAULT_SPECIAL in vocab:
        named.append(GPT2_DEFAULT_SPECIAL)
    return [token for token in dict.fromkeys(named) if token]


def _content(value: Any) -> str:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken object with its content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
