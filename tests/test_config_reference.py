"""docs/config.md, the model.json and train.json reference, is what scripts/config_reference.py writes from the
config schema today: a key added to ModelConfig or TrainConfig, a default or a choice changed, or a meaning edited in
scripts/config_meanings.py makes the page stale, and this test says how to write it again."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from types import ModuleType

import pytest
from clihelp import REPO

from nanopt.config.model_config import ModelConfig
from nanopt.config.schema import TrainConfig


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_what_the_schema_gives():
    page = REPO / "docs" / "config.md"
    expected = generator().render()
    if not page.is_file() or page.read_text(encoding="utf-8") != expected:
        pytest.fail("docs/config.md is stale: run `make docs` (python scripts/config_reference.py) and commit it")


@pytest.mark.parametrize("cls", [ModelConfig, TrainConfig], ids=["model.json", "train.json"])
def test_every_key_has_a_row_with_its_default(cls):
    text = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(cls):
        row = re.search(rf"^\| \[?`{field.name}`\]?\S* \|[^|]*\| ([^|]*) \|", text, re.M)
        assert row, f"docs/config.md has no row for {cls.__name__}.{field.name}"
        if field.default is dataclasses.MISSING:
            assert row.group(1) == "required", field.name
        elif isinstance(field.default, bool):
            assert row.group(1) == f"`{str(field.default).lower()}`", field.name


def test_a_key_without_a_meaning_is_named(monkeypatch: pytest.MonkeyPatch):
    module = generator()
    monkeypatch.delitem(module.meanings.TRAIN, "seed")
    with pytest.raises(SystemExit, match="keys without a one-line meaning: \\['seed'\\]"):
        module.render()
