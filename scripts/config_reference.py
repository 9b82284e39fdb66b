"""Write docs/config.md, the model.json and train.json reference, from the config schema.

Each key's type, default and listed values come from the dataclasses themselves (nanopt.config.model_config's
ModelConfig, nanopt.config.schema's TrainConfig); its one-line meaning, the range the checks enforce and the longer
description from scripts/config_meanings.py. tests/test_config_reference.py fails when the page on disk is not
what this writes (a key added, a default changed, a meaning edited) and tells you to run it:

    python scripts/config_reference.py           # write docs/config.md (also: make docs)
    python scripts/config_reference.py --check   # exit 1 when docs/config.md is stale
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "config.md"
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

import config_meanings as meanings  # noqa: E402

from nanopt.config.model_config import ModelConfig  # noqa: E402
from nanopt.config.schema import TOKEN_COUNT_KEYS, TrainConfig  # noqa: E402

WIDTH = 120
TYPE_WORDS = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object", list: "list",
              type(None): "null", Any: "any"}


def _flat(text: str) -> str:
    """A string of config_meanings as one line, the table's escaped pipes as plain ones."""
    return " ".join(text.split()).replace("\\|", "|")


def _wrap(text: str) -> str:
    return "\n".join(textwrap.wrap(_flat(text), WIDTH, break_long_words=False, break_on_hyphens=False))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a type: `bool | int | Literal["selective"]` -> [bool, int, Literal["selective"]]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [member for arg in typing.get_args(annotation) for member in _members(arg)]
    return [annotation]


def type_text(name: str, annotation: Any) -> str:
    words = []
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if origin is Literal:
            word = " or ".join(dict.fromkeys(TYPE_WORDS[type(value)] for value in typing.get_args(member)))
        else:
            word = TYPE_WORDS[origin or member]
        if word not in words:
            words.append(word)
    if name in TOKEN_COUNT_KEYS:
        words.insert(words.index("integer") + 1, 'a count ("2.5B")')
    return " or ".join(words)


def allowed_text(name: str, annotation: Any) -> str:
    listed = [json.dumps(value) for member in _members(annotation) if typing.get_origin(member) is Literal
              for value in typing.get_args(member)]
    if name in meanings.ALLOWED:
        return meanings.ALLOWED[name]
    if listed and bool in _members(annotation):  # `"auto"` or a boolean
        listed = ["true", "false", *listed]
    return ", ".join(f"`{value}`" for value in listed)


def default_text(field: dataclasses.Field) -> str:
    if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
        return "required"
    value = field.default
    shown = json.dumps(value)  # floats as Python writes them: 0.0006, 1e-08, 1.0
    if value is None and field.name in meanings.NULL_MEANS:
        return f"`null`: {meanings.NULL_MEANS[field.name]}"
    return f"`{shown}`"


def key_table(cls: type, lines: dict[str, str], details: list[tuple[tuple[str, ...], str, str]]) -> str:
    fields = dataclasses.fields(cls)
    names = [field.name for field in fields]
    missing = [name for name in names if name not in lines]
    unknown = [name for name in [*lines, *(key for keys, _, _ in details for key in keys)] if name not in names]
    if missing or unknown:
        raise SystemExit(f"scripts/config_meanings.py: {cls.__name__}: keys without a one-line meaning: {missing}; "
                         f"meanings or descriptions of keys the schema does not have: {unknown}")
    with_details = {key: keys for keys, _, _ in details for key in keys}
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
    for field in fields:
        name = field.name
        key = f"[`{name}`](#{_anchor(with_details[name])})" if name in with_details else f"`{name}`"
        rows.append(f"| {key} | {type_text(name, hints[name])} | {_cell(default_text(field))} | "
                    f"{_cell(allowed_text(name, hints[name]))} | {_cell(lines[name])} |")
    return "\n".join(rows) + "\n"


def _anchor(keys: tuple[str, ...]) -> str:
    """GitHub's anchor for the heading `### `a`, `b``: a-b."""
    return "-".join(keys)


def detail_sections(details: list[tuple[tuple[str, ...], str, str]]) -> str:
    out = []
    for keys, default, text in details:
        heading = ", ".join(f"`{key}`" for key in keys)
        text = _flat(text)
        text = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
        out.append(f"### {heading}\n\nDefault: {default}.\n\n{_wrap(text)}\n")
    return "\n".join(out)


def render() -> str:
    m = meanings
    return f"""# model.json and train.json reference

<!-- Generated by scripts/config_reference.py (make docs) from nanopt/config/model_config.py,
nanopt/config/schema.py and scripts/config_meanings.py: edit those, not this page. -->

A run directory holds two configs: model.json (the architecture) and train.json (data, batch, optimizer, schedule,
eval, checkpoint and runtime settings). Each table gives every key the schema has: its JSON type, its default, the
values the checks allow, and one line on what it does; a linked key has its full description below the table.
Keys that start with `_` are comments (each preset's `_note` explains its numbers).

{_wrap(m.MISTAKES)}

- [model.json](#modeljson)
- [train.json](#trainjson)

## model.json

{_wrap(m.MODEL_INTRO)}

{key_table(ModelConfig, m.MODEL, m.MODEL_DETAILS)}
{_wrap(m.MODEL_OPTIONS_INTRO)}

{detail_sections(m.MODEL_DETAILS)}
{_wrap(m.MODEL_OPTIONS_COST)}

## train.json

{key_table(TrainConfig, m.TRAIN, m.TRAIN_DETAILS)}
{_wrap(m.TRAIN_TOKEN_COUNTS)}

{_wrap(m.TRAIN_GRAD_ACCUM)}

{_wrap(m.TRAIN_LOGGERS)}

Batch-size warmup and sequence-length stages, with worked examples: [training](training.md#batch-size-warmup).

{detail_sections(m.TRAIN_DETAILS)}"""


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(REPO)} is stale: run `python scripts/config_reference.py` (or make docs)",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
