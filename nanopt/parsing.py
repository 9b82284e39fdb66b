"""Typed values from JSON files and the command line, each mistake one line naming the file, the key or the option.

The config dataclasses (nanopt.config) and the option classes of every command build on these: `from_dict` checks
keys and types strictly, `read_json` / `parse_json_text` turn every way JSON can be refused into one ConfigError
(or the caller's error type), `check_option` is the one range check of a numeric option, `parse_token_count` reads
counts such as 2.5B (options and train.json alike), `save_json` writes atomically.

Files that may come from someone else are opened here and nowhere else: `open_regular` (never blocks on a named
pipe, never opens a device) and `read_capped` (never reads more than a cap), under read_json and every reader of
a dataset's files (nanopt.data) and of metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import stat
import types
import typing
from dataclasses import fields
from decimal import Decimal, DecimalException
from pathlib import Path
from typing import Any, BinaryIO, Literal, Union, get_args, get_origin

from nanopt.errors import ConfigError, NanoptError
from nanopt.files import file_kind, replace_file

INT64_MAX = 2**63 - 1


def show_value(value: Any, limit: int = 40) -> str:
    """A value as it goes into a one-line message: its repr, shortened if long (a 100,000-character string)."""
    if isinstance(value, int) and abs(value).bit_length() > 128:  # repr refuses past 4,300 digits
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def from_dict(cls: type, data: Any, source: str) -> Any:
    """Build a config dataclass from parsed JSON, checking keys and types strictly."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object at the top level, got {type(data).__name__}",
                          "the file should look like {\"key\": value, ...}")
    known = {f.name: f for f in fields(cls)}
    data = {k: v for k, v in data.items() if not k.startswith("_")}  # "_note"-style keys are comments
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{source}: unknown key '{key}'", hint)
    hints = typing.get_type_hints(cls)
    missing = [f.name for f in fields(cls) if f.name not in data and _is_required(f)]
    if missing:
        raise ConfigError(f"{source}: missing required key '{missing[0]}'",
                          f"add it; required keys: {', '.join(missing)}")
    values = {key: _coerce(value, hints[key], f"{source}: key '{key}'") for key, value in data.items()}
    return cls(**values)


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Return value if it matches annotation (ints may stand for floats; integral floats like 2.5e9 for ints)."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(annotation):
            try:
                return _coerce(value, option, where)
            except ConfigError as exc:
                errors.append(exc)
        hint = next((e.hint for e in errors if e.hint), "")  # null's own error has none
        raise ConfigError(f"{where}: {show_value(value)} is not {_describe(annotation)}", hint)
    if origin is Literal:
        if value in get_args(annotation) and type(value) in {type(a) for a in get_args(annotation)}:
            return value
        raise ConfigError(f"{where}: {show_value(value)} is not one of {_describe(annotation)}",
                          f"use one of {_describe(annotation)}")
    if annotation is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null", "")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {show_value(value)}", "JSON booleans are true / false")
    if annotation is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT64_MAX:
                raise ConfigError(f"{where}: {show_value(value)} is out of range (more than 2**63 - 1)",
                                  "check for a typo: every integer here fits in 64 bits")
            return value
        raise ConfigError(f"{where}: expected an integer, got {show_value(value)}", "write a whole number such as 1024")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value):
            return float(value)
        raise ConfigError(f"{where}: expected a finite number, got {show_value(value)}", "write a number such as 6e-4")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {show_value(value)}", "put the value in double quotes")
    if origin in (dict, list):  # a JSON object or array whose contents the config's own validate() checks
        if isinstance(value, origin):
            return value
        shape = "{\"key\": value, ...}" if origin is dict else "[item, ...]"
        raise ConfigError(f"{where}: expected {_describe(annotation)}, got {show_value(value)}",
                          f"write it as {shape}; see docs/config.md")
    raise TypeError(f"unsupported annotation {annotation!r}")  # a bug in nanopt, not a user error


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float (hundreds of digits)
        return False


def _describe(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " / ".join(json.dumps(a) for a in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    if get_origin(annotation) in (dict, list):
        return "a JSON object" if get_origin(annotation) is dict else "a JSON list"
    return {int: "an integer", float: "a number", bool: "true / false", str: "a string",
            type(None): "null"}.get(annotation, str(annotation))


# A JSON file nanopt writes (model.json, train.json, a dataset's or a checkpoint's meta.json, eval.json) is a few
# kilobytes; this cap only keeps a stranger's 10 GB file from being read into memory whole. Its nesting: six
# levels at most (a checkpoint's RNG state), and anything past JSON_MAX_DEPTH would only reach code (comparisons,
# json.dumps) that recurses.
JSON_MAX_BYTES = 64 << 20
JSON_MAX_DEPTH = 64
CONFIG_HINT = "copy one from runs/demo or a preset in runs/"

def open_regular(path: Path, error: type[NanoptError], hint: str, what: str = "file") -> BinaryIO:
    """`path` opened for reading in binary, if it is a regular file: the one way nanopt opens a file that may come
    from someone else (a dataset's meta.json, shards and tokenizer.json, a run's JSON files, metrics.jsonl).

    Anything else is `error`, one line: a named pipe would block the read forever (a tar archive can carry one), a
    device may act when opened, a directory is a mistake. The kind is looked up before the open, so nothing that is
    not a regular file is ever opened, and checked again on what was opened (O_NONBLOCK: an open that raced a swap
    to a pipe returns at once), so a file swapped in between is caught too. Links are followed: reading through
    one changes nothing, a dataset may link its shards to another disk, and what is checked is what the link leads
    to (O_NOFOLLOW belongs to writing, where a link could redirect the write)."""
    try:
        _refuse_irregular(path, os.stat(path).st_mode, error, hint, what)  # before the open: a device may act
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found", hint) from None
    except OSError as exc:  # no permission, a loop of links, a name too long
        raise error(f"{path}: cannot read it ({exc.strerror})", hint) from None
    try:
        _refuse_irregular(path, os.fstat(fd).st_mode, error, hint, what)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _refuse_irregular(path: Path, mode: int, error: type[NanoptError], hint: str, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise error(f"{path}: is {file_kind(mode)}, not a {what}", hint)


def read_capped(path: Path, max_bytes: int, error: type[NanoptError], hint: str, what: str = "file") -> bytes:
    """The whole of a regular file (see open_regular) of at most `max_bytes`; a larger one is `error`, refused from
    its size before a byte is read (and, should it grow meanwhile or not report a size, after max_bytes + 1)."""
    with open_regular(path, error, hint, what) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            data = f.read(max_bytes + 1) if size <= max_bytes else b""
        except OSError as exc:  # EIO from a failing disk; EISDIR and EAGAIN cannot happen on a regular file
            raise error(f"{path}: cannot read it ({exc.strerror})", hint) from None
    if size > max_bytes or len(data) > max_bytes:
        raise error(f"{path}: {max(size, len(data)):,} bytes, more than the {_size(max_bytes)} a {what} nanopt "
                    "reads may hold", hint)
    return data


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n:,} bytes"


def read_json(path: Path, *, error: type[NanoptError] = ConfigError, hint: str = CONFIG_HINT,
              max_bytes: int = JSON_MAX_BYTES, finite: bool = False, contents_hint: str | None = None) -> Any:
    """A JSON file, read without blocking and at most `max_bytes` (open_regular, read_capped), parsed by
    parse_json_text: every way it can be refused (missing, not a regular file, too large, not UTF-8, malformed,
    too deep, a number past Python's int limit, NaN or an infinity with `finite`) is `error`, one line naming it.
    `hint` goes with a file that cannot be read; `contents_hint`, if given, with contents that cannot be parsed
    (for a file nanopt wrote: how to make it again), else a hint for a person editing it (a trailing comma)."""
    data = read_capped(path, max_bytes, error, hint, "JSON file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text", contents_hint or "save the file as UTF-8 JSON") from None
    return parse_json_text(text, str(path), error=error, finite=finite, hint=contents_hint)


def parse_json_text(text: str, where: str, *, error: type[NanoptError] = ConfigError, finite: bool = False,
                    hint: str | None = None) -> Any:
    """json.loads, with every way it can refuse text (not only JSONDecodeError) as one `error` (with `hint`, else
    one for a person editing the text); with `finite`, NaN, Infinity and numbers past a float (1e400) are refused
    too. Nesting deeper than JSON_MAX_DEPTH is refused even where json.loads could read it: code that walks the
    value later (json.dumps, ==) recurses as deep."""
    def refuse(problem: str, edit_hint: str) -> NanoptError:
        return error(f"{where}: {problem}", hint or edit_hint)

    def constant(name: str) -> Any:
        raise refuse(f"{name} where a finite number belongs", "write a finite number")

    def finite_float(number: str) -> float:
        if not math.isfinite(value := float(number)):
            raise refuse(f"{show_value(number)} is past the largest number a float holds", "write a finite number")
        return value

    too_deep = f"malformed JSON: nested more than {JSON_MAX_DEPTH} levels deep"
    try:
        value = json.loads(text, **({"parse_constant": constant, "parse_float": finite_float} if finite else {}))
    except json.JSONDecodeError as exc:
        raise refuse(f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
                     "check for a trailing comma, a missing quote or a cut-off end") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise refuse(f"malformed JSON: {str(exc).split(';')[0]}", "check for a typo in a number") from None
    except RecursionError:  # json.loads gives up at about 1,000 levels
        raise refuse(too_deep, "check for runaway brackets") from None
    if _deeper_than(value, JSON_MAX_DEPTH):
        raise refuse(too_deep, "check for runaway brackets")
    return value


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels deep; a loop, not recursion, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        nested = [child for child in children if isinstance(child, (dict, list))]
        if nested and depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in nested)
    return False


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs: VALUE is read as JSON (numbers, true, null, "str"), else taken as a string."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE", "e.g. --set learning_rate=3e-4")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:  # not JSON: the text itself, as a string
            overrides[key.strip()] = raw
        except (ValueError, RecursionError):  # JSON json.loads gives up on (5,000 digits, runaway brackets)
            overrides[key.strip()] = parse_json_text(raw, f"--set {key.strip()}")  # raises a ConfigError
    return overrides


TOKEN_COUNT_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_TOKEN_COUNT = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)
TOKEN_COUNT_HINT = "write e.g. 500M, 2.5B, 20e9 or 1000000"


def parse_token_count(text: str, option: str, hint: str = TOKEN_COUNT_HINT) -> int:
    """A token count as people write it (`3.3B`, `20e9`, `500M`, `1_000_000`) as an exact positive integer: decimal
    arithmetic, so `3.3B` is 3300000000, not 3299999999. `option` names where it was written in the one-line error
    (`--max-tokens`, or `train.json: key 'train_tokens':`)."""
    match = _TOKEN_COUNT.match(text)
    if not match:
        raise ConfigError(f"{option} {_shown(text)} is not a token count", hint)
    digits, suffix = match.group(1).replace("_", "").replace(",", ""), match.group(2).upper()
    try:
        value = Decimal(digits) * TOKEN_COUNT_SUFFIXES[suffix]
        whole = value == value.to_integral_value()
    except DecimalException:  # an exponent past what decimal arithmetic holds (1e999999999)
        raise ConfigError(f"{option} {_shown(text)} is not a token count", hint) from None
    if not whole:
        raise ConfigError(f"{option} {_shown(text)} is not a whole number of tokens", hint)
    if value <= 0:
        raise ConfigError(f"{option} {_shown(text)} must be positive", hint)
    # Token counts are int64 in numpy and torch; a count past that is a typo (1e30), and int() of 1e5000 would be
    # a number too long to print.
    if value > INT64_MAX:
        raise ConfigError(f"{option} {_shown(text)} is more than 2**63 - 1 tokens", hint)
    return int(value)


def _shown(text: str, limit: int = 40) -> str:
    """The text as typed, shortened if long (9 repeated 5,000 times), for a one-line message."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def check_option(option: str, value: float | None, low: float, high: float, hint: str, *,
                 above_low: bool = False) -> None:
    """ConfigError unless `value` (None: not given) is a finite number in [low, high], or (low, high] with
    `above_low`. The one range check of the library's option classes (estimate, find-batch, profile, eval), so a
    NaN, an infinity or a number past what the option can mean is refused with its option name, in one line."""
    if value is None:
        return
    in_range = _finite(value) and (value > low if above_low else value >= low) and value <= high
    if not in_range:
        interval = f"{'(' if above_low else '['}{_number(low)}, {_number(high)}]"
        raise ConfigError(f"{option}: {show_value(value)} is outside {interval}", hint)


def _number(x: float) -> str:
    """1,000,000 for whole numbers people read at a glance, 1e+18 or 0.99 otherwise."""
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def save_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (nanopt.files.replace_file): a temporary file renamed into place, so a reader never
    sees half a file, never written through a link. The file gets 0644 less the umask, never the mode of the file it
    replaces: a train.json `find-batch --write` rewrites (it may hold `on_exit`, a shell command) is never left
    writable by others."""
    replace_file(path, json.dumps(data, indent=2) + "\n")


def path_kind(path: Path, error: type[NanoptError], hint: str) -> str:
    """"dir", "file" or "missing": what a path given by a person is. One that the OS cannot even look up (a name too
    long, a loop of symbolic links) is `error`, one line, rather than an OSError traceback."""
    try:
        return "dir" if path.is_dir() else "file" if path.is_file() else "missing"
    except OSError as exc:
        raise error(f"{show_value(str(path), 60)}: not a usable path ({exc.strerror})", hint) from None


def plain_path(path: Path | str) -> Path:
    """A path a person gave, as every message shows it and as it is opened: `..` and `.` folded away (a run's data
    "../../data/x" is data/x, not runs/mine/../../data/x), relative to the current directory when under it, and
    absolute when not (`--data ../x`, `--set data=../x` made absolute and a train.json's "../../../x" all read
    /home/me/x). Train and eval both name datasets through this, so one dataset reads the same in both. A `..`
    after a symbolic link names another place once folded: that path stays as given."""
    text = os.fspath(path)
    try:
        here = os.getcwd()
        folded = os.path.normpath(os.path.join(here, text))
        if os.path.realpath(folded) != os.path.realpath(text):
            return Path(text)
    except (OSError, ValueError):  # a NUL byte, a deleted working directory: the path as given
        return Path(text)
    if folded == here or folded.startswith(os.path.join(here, "")):
        return Path(os.path.relpath(folded, here))
    return Path(folded)
