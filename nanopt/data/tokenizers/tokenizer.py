"""Tokenizers: load one by Hugging Face name or local file, or train a byte-level BPE; find its end-of-text token.

Every dataset stores the exact tokenizer it was made with (tokenizer.json, Hugging Face `tokenizers` format) and the
id of the token that separates documents. A trained tokenizer always ends documents with "<|endoftext|>". For a
loaded one (find_eos): `eos_token` when given; a nanopt dataset's own (its meta.json), so a dataset made with another
one's tokenizer matches it; else the special token that tokenizer_config.json beside a local file names, or the
first of DOCUMENT_END_TOKENS the tokenizer has, never a chat end-of-turn token.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanopt.data.corpus.hub import OFFLINE_HINT, hub_offline, hub_unreachable
from nanopt.data.shards import FORMAT
from nanopt.data.tokenizers.bpe_files import has_bpe_files, read_bpe_files
from nanopt.errors import ConfigError, DataError, NanoptError
from nanopt.files import write_file
from nanopt.parsing import check_option, read_capped, read_json
from nanopt.untrusted_text import shell_word

ENDOFTEXT = "<|endoftext|>"
MIN_VOCAB_SIZE = 258  # the 256 byte symbols, the end-of-text token and at least one merge
MAX_VOCAB_SIZE = 2**32
# The largest published tokenizer.json files are tens of MB (vocabularies of 256k tokens); this cap only keeps a
# stranger's file from being read into memory whole.
TOKENIZER_MAX_BYTES = 256 << 20

# The tokens that end a document in well-known tokenizer families, in the order they are preferred when a tokenizer
# has several and its tokenizer_config.json names none of them. Only special tokens count: a vocabulary may hold
# "</s>" as plain text (an HTML tag), which must not end documents.
DOCUMENT_END_TOKENS = (
    "<|endoftext|>",  # GPT-2, GPT-NeoX, StarCoder, Qwen, Phi, Falcon, OLMo; nanopt's trained BPE
    "<|end_of_text|>",  # Llama 3
    "</s>",  # Llama 2, Mistral, Code Llama, T5, BLOOM
    "<eos>",  # Gemma
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek (full-width bars, a SentencePiece space)
    "<EOT>",  # tokenizers that call their end of text so
    "<|eos|>",
    "[EOS]",
    "<EOS>",
)
# Chat end-of-turn tokens, never taken for the end of a document, even when tokenizer_config.json names one (the
# instruct variants of Llama 3 and Qwen do): pretraining separates documents, not turns of a conversation. Ending
# every document with one would teach the model that any text is a finished chat reply, and leave the tokenizer's
# own end-of-text token untrained. Given with --eos-token, one is used as asked.
CHAT_END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


@dataclass
class NamedTokenizer:
    """A tokenizer with where it came from and which token ends a document."""

    tokenizer: Any  # tokenizers.Tokenizer
    source: str  # a Hugging Face name, a local path, or "trained"
    eos_token: str
    eos_id: int
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. what a trained tokenizer was trained on

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "model": type(self.tokenizer.model).__name__, "vocab_size": self.vocab_size,
                "eos_token": self.eos_token, "eos_id": self.eos_id, **self.extra}


# Far past the cores of any machine: a thread count past it is a typo (an environment variable of 5,000 digits).
MAX_THREADS = 4096


def set_threads(threads: int | None) -> None:
    """Cap the tokenizers library's worker threads. It reads this once, at its first parallel call in a process."""
    if threads is not None:
        check_option("--threads", threads, 1, MAX_THREADS, "leave it out to use every core")
        os.environ["RAYON_NUM_THREADS"] = str(threads)


def load_tokenizer(name_or_path: str, eos_token: str | None = None) -> NamedTokenizer:
    """A local tokenizer.json (or a directory holding one, e.g. a dataset dir; or GPT-2's vocab.json and
    merges.txt, nanopt.data.tokenizers.bpe_files), else a Hugging Face hub name."""
    path = Path(name_or_path).expanduser()
    bpe_files = path.is_dir() and not os.path.lexists(path / "tokenizer.json") and has_bpe_files(path)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not os.path.lexists(path) and not bpe_files:
            raise DataError(f"{name_or_path}: directory has no tokenizer.json, nor vocab.json and merges.txt",
                            "pass the tokenizer.json file, a directory containing one (or GPT-2's vocab.json and "
                            "merges.txt), or a Hugging Face name")
    extra: dict[str, Any] = {}
    if bpe_files or os.path.lexists(path):  # a file, or something in its place that is refused in one line
        tokenizer = read_bpe_files(path.parent) if bpe_files else read_tokenizer_file(path)
        dataset_eos = _eos_of_dataset(path.parent, tokenizer)
        if dataset_eos is not None:
            extra["dataset"] = str(path.parent)
        config_eos = _eos_from_tokenizer_config(path.parent / "tokenizer_config.json")
        source = str(path.parent if bpe_files else path)
    elif name_or_path.endswith(".json"):
        raise DataError(f"{name_or_path}: tokenizer file not found", "check the path")
    else:
        tokenizer = _from_hub(name_or_path)
        dataset_eos = config_eos = None
        source = name_or_path
    _disable_padding_and_truncation(tokenizer)
    eos, eos_id = find_eos(tokenizer, source, requested=eos_token or dataset_eos, suggested=config_eos)
    return NamedTokenizer(tokenizer, source, eos, eos_id, extra)


def read_tokenizer_file(path: Path, hint: str = "pass a file saved by Hugging Face tokenizers (tokenizer.json)",
                        error: type[NanoptError] = DataError) -> Any:
    """A parsed tokenizer.json, or `error` in one line naming the file: the one place that reads one, for a
    tokenize --tokenizer, a dataset's, a checkpoint's and an export's alike. Read by nanopt (a regular file of at
    most TOKENIZER_MAX_BYTES: a named pipe would block the library's own read) and parsed from memory."""
    from tokenizers import Tokenizer

    data = read_capped(path, TOKENIZER_MAX_BYTES, error, hint, "tokenizer file")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise error(f"{path}: not a Hugging Face tokenizers file (not UTF-8 text)", hint) from None
    except Exception as exc:  # the library raises a bare Exception for any malformed file
        raise error(f"{path}: not a Hugging Face tokenizers file ({exc})", hint) from None


def _from_hub(name: str) -> Any:
    """The hub's tokenizer.json of `name`; where the hub cannot be reached, the copy in the local cache, else a
    DataError at once (not after huggingface_hub's 23 s of retries)."""
    from tokenizers import Tokenizer

    unreachable = hub_unreachable()
    if unreachable is not None:
        cached = _cached_tokenizer_file(name)
        if cached is not None:
            return read_tokenizer_file(cached)
        raise DataError(f"could not load tokenizer '{name}': the Hugging Face hub cannot be reached ({unreachable}) "
                        "and the local cache has no copy of it", OFFLINE_HINT)
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as exc:  # network, authentication and missing-repo errors all surface as Exception here
        where = " (HF_HUB_OFFLINE is set: the local cache only)" if hub_offline() else ""
        raise DataError(f"could not load tokenizer '{name}' from the Hugging Face hub{where} ({exc})",
                        "check the name (e.g. gpt2) and the internet connection (HF_HUB_OFFLINE=1 uses the local "
                        "cache only), or pass a local tokenizer.json or directory") from None


def _cached_tokenizer_file(name: str) -> Path | None:
    """tokenizer.json of hub repo `name` in the local Hugging Face cache, as huggingface_hub finds it offline."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id=name, filename="tokenizer.json")
    except Exception:  # an invalid repo id, or no huggingface_hub: nothing cached to offer
        return None
    return Path(found) if isinstance(found, str) else None


def _disable_padding_and_truncation(tokenizer: Any) -> None:
    # Some published tokenizer.json files enable these for fine-tuning; pretokenizing must keep every token.
    tokenizer.no_padding()
    tokenizer.no_truncation()


def _eos_of_dataset(directory: Path, tokenizer: Any) -> str | None:
    """The end-of-text token a nanopt dataset's meta.json records, when `directory` is one: a dataset made with its
    tokenizer then separates documents with the same token, whatever the detection below would pick."""
    try:
        meta = read_json(directory / "meta.json", error=DataError)
    except NanoptError:  # none, or not one nanopt wrote: the directory is not a dataset
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("eos_token"), str):
        return None
    if tokenizer.token_to_id(meta["eos_token"]) is None:
        raise DataError(f"{directory / 'meta.json'}: eos_token {meta['eos_token']!r} is not in the dataset's "
                        "tokenizer.json", "the dataset is damaged: re-create it, or pass its tokenizer's own "
                        "source with --tokenizer")
    return meta["eos_token"]


def _eos_from_tokenizer_config(path: Path) -> str | None:
    """The eos_token of a transformers tokenizer_config.json beside the tokenizer, if there is one."""
    try:
        value = read_json(path, error=DataError).get("eos_token")
    except (NanoptError, AttributeError):  # none, unreadable, or not an object: no suggestion
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_eos(tokenizer: Any, source: str, requested: str | None = None,
             suggested: str | None = None) -> tuple[str, int]:
    """The end-of-text token and its id: `requested` if given (any token of the vocabulary), else the special token
    `suggested` (tokenizer_config.json's eos_token) unless it ends chat turns, else the first special token of
    DOCUMENT_END_TOKENS."""
    if requested is not None:
        token_id = tokenizer.token_to_id(requested)
        if token_id is None:
            raise DataError(f"--eos-token {requested!r} is not in the vocabulary of tokenizer {source}",
                            f"special tokens it has: {_special_tokens(tokenizer)[:12]}")
        return requested, token_id
    specials = _special_tokens(tokenizer)
    preferred = [suggested] if suggested and suggested not in CHAT_END_TOKENS else []
    for token in preferred + list(DOCUMENT_END_TOKENS):
        if token in specials:
            return token, tokenizer.token_to_id(token)
    chat = [token for token in CHAT_END_TOKENS if token in specials]
    why = f"; {chat[0]} ends a chat turn, not a document" if chat else ""
    raise DataError(f"cannot tell which token ends a document in tokenizer {source} "
                    f"(special tokens: {specials[:12] or 'none'}){why}",
                    f"name it with --eos-token TOKEN, e.g. --eos-token {shell_word(chat[0] if chat else '</s>')}")


def _special_tokens(tokenizer: Any) -> list[str]:
    added = tokenizer.get_added_tokens_decoder()
    return [added[i].content for i in sorted(added) if added[i].special]


def check_vocab_size(vocab_size: int) -> None:
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size {vocab_size} is out of range",
                          f"use {MIN_VOCAB_SIZE} to {MAX_VOCAB_SIZE}; e.g. 4096 for a CPU demo, 32768-65536 "
                          "for a real corpus (the token dtype stays uint16 up to 65536)")


def train_bpe(texts: Iterable[str], vocab_size: int) -> NamedTokenizer:
    """Train a byte-level BPE (GPT-2 style: any byte sequence is encodable, nothing is unknown) on `texts`.

    The vocabulary may come out smaller than asked when the sample has too few distinct pairs.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    sample = _CountingIterator(texts)
    tokenizer.train_from_iterator(sample, trainer)
    if sample.documents == 0:
        raise DataError("no documents to train the tokenizer on", "check the source (is it empty?)")
    return NamedTokenizer(tokenizer, "trained", ENDOFTEXT, tokenizer.token_to_id(ENDOFTEXT),
                          {"trained_on": {"documents": sample.documents, "bytes": sample.bytes},
                           "requested_vocab_size": vocab_size})


class _CountingIterator:
    """Passes texts through while counting them, to record what a trained tokenizer saw."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = iter(texts)
        self.documents = 0
        self.bytes = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> str:
        text = next(self._texts)
        self.documents += 1
        self.bytes += len(text.encode("utf-8"))
        return text


def save_tokenizer(named: NamedTokenizer, path: Path) -> None:
    write_file(path, named.tokenizer.to_str(pretty=True))  # the bytes tokenizer.save writes, never through a link


def piece_ends(text: str, max_chars: int) -> list[int]:
    """Where to cut `text` into pieces of at most `max_chars` characters that encode to the same ids as the whole.

    The tokenizer's work space grows with the text it is given at once (~135 bytes per byte), so a long document is
    encoded piece by piece. BPE merges never cross a pre-token boundary, so a cut there changes no id. The cuts
    used, in order of preference, within the second half of each piece:
    - before a space that follows a non-space: a boundary for the GPT-2 and Llama 3 regexes and for Metaspace
      (SentencePiece-style) pre-tokenizers alike, as none of their pre-tokens runs from a non-space into a space
      (and a piece that starts with a space gets no second word-start mark from Metaspace);
    - before a newline that follows a letter or digit: exact for the byte-level regexes (Llama 3 keeps punctuation
      and the newlines after it together, hence not after punctuation); Metaspace may add a word-start mark there;
    - else exactly at the bound (a minified dump, base64): the ids may differ around that cut only.
    Prose has a space in every few characters, so the last two are for text that has almost none.
    Returns the end offset of each piece; the last is len(text).
    """
    ends: list[int] = []
    start = 0
    while len(text) - start > max_chars:
        low, high = start + max(1, max_chars // 2), start + max_chars
        cut = (_last_cut_before(text, " ", low, high, _not_space)
               or _last_cut_before(text, "\n", low, high, str.isalnum) or high)
        ends.append(cut)
        start = cut
    ends.append(len(text))
    return ends


def _not_space(char: str) -> bool:
    return not char.isspace()


def _last_cut_before(text: str, char: str, low: int, high: int, follows: Callable[[str], bool]) -> int | None:
    """The largest p in [low, high] with text[p] == char and follows(text[p - 1]), or None (low >= 1)."""
    position = text.rfind(char, low, high + 1)
    while position != -1 and not follows(text[position - 1]):
        position = text.rfind(char, low, position)
    return None if position == -1 else position
