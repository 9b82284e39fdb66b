"""`nanopt import DIR` of a sharded transformers directory whose model.safetensors.index.json comes from a stranger:
its `weight_map` of any JSON type, or an object holding any JSON values (names outside the directory, names the file
system cannot take, lists, objects, non-finite numbers), is imported or refused in one line, exit 2, with no run
left behind; never a traceback. Derandomized; NANOPT_FUZZ_EXAMPLES asks for more examples.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from clihelp import assert_user_error
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from importhelp import llama, save

pytest.importorskip("transformers")

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "40"))
PROPERTY = settings(derandomize=True, database=None, deadline=timedelta(seconds=30), max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
INDEX = "model.safetensors.index.json"

# Shard names a crafted index may hold instead of the real ones.
NAMES = ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors", "..\\x.safetensors",
         ".hidden.safetensors", ".safetensors", "model.bin", "missing.safetensors", "a\x00.safetensors",
         "\ud800.safetensors", "a\nb.safetensors", "\x1b[2Ka.safetensors", "x" * 300 + ".safetensors", ""]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> Path:
    """A small Llama saved in several shards with its index, and the tiny dataset's tokenizer."""
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    source = save(llama(vocab, False), tmp_path_factory.mktemp("hf") / "sharded", tiny_dataset / "tokenizer.json",
                  max_shard_size="40KB")
    assert len(set(json.loads((source / INDEX).read_text())["weight_map"].values())) > 1
    return source


def json_values(shards: list[str]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from([2**70, -(2**63), 10**300]),
                        st.floats(), st.text(max_size=12), st.sampled_from(shards + NAMES))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=8), inner, max_size=3), max_leaves=8)


@st.composite
def weight_maps(draw: st.DrawFn, real: dict[str, str]) -> Any:
    """Any JSON value; the real map with some values replaced; a map of crafted names and values; or every real
    shard under keys of any text (keys go unused: each shard's header says what it holds), which imports."""
    shards = sorted(set(real.values()))
    values = json_values(shards)
    kind = draw(st.sampled_from(["any", "edited", "crafted", "keys"]))
    if kind == "any":
        return draw(values)
    if kind == "crafted":
        return draw(st.dictionaries(st.text(max_size=12), values, max_size=4))
    if kind == "keys":
        named = shards + draw(st.lists(st.sampled_from(shards), max_size=3))
        keys = draw(st.lists(st.text(max_size=12), min_size=len(named), max_size=len(named), unique=True))
        return dict(zip(keys, named, strict=True))
    edited = dict(real)
    for key in draw(st.lists(st.sampled_from(sorted(real)), min_size=1, max_size=3, unique=True)):
        edited[key] = draw(values)
    return edited


def _with_weight_map(sharded: Path, root: Path, weight_map: Any) -> Path:
    """A copy of the sharded source in root/source whose index holds `weight_map`. json.dumps writes a lone
    surrogate as the \\ud800 escape a stranger's file may hold, and NaN as NaN."""
    source = Path(shutil.copytree(sharded, root / "source"))
    index = json.loads((source / INDEX).read_text())
    (source / INDEX).write_text(json.dumps({**index, "weight_map": weight_map}))
    return source


def assert_refused_without_a_run(result: Any, root: Path, *fragments: str) -> None:
    assert_user_error(result, *fragments)
    assert sorted(p.name for p in root.iterdir()) == ["source"]  # no run, no staging directory


@PROPERTY
@given(data=st.data())
def test_any_weight_map_is_imported_or_one_line(data: st.DataObject, sharded: Path, tmp_path_factory,
                                                cli_in_process):
    real = json.loads((sharded / INDEX).read_text())["weight_map"]
    root = tmp_path_factory.mktemp("case")
    source = _with_weight_map(sharded, root, data.draw(weight_maps(real), label="weight_map"))
    result = cli_in_process("import", source, "--run", root / "run")
    event("imported" if result.returncode == 0 else "refused")
    if result.returncode == 0:
        assert (root / "run" / "checkpoints" / "step-000000").is_dir()
    else:
        assert_refused_without_a_run(result, root)


@pytest.mark.parametrize("weight_map, fragment", [
    ({"model.embed_tokens.weight": ["model-00001-of-00002.safetensors"]}, "weight_map names ['model-00001"),
    ({"model.embed_tokens.weight": {"file": "x.safetensors"}}, "weight_map names {'file'"),
    ({"model.embed_tokens.weight": "../outside.safetensors"}, "'../outside.safetensors', not a .safetensors file"),
    ({"model.embed_tokens.weight": "a\x00.safetensors"}, "'a\\x00.safetensors'"),
    ({"model.embed_tokens.weight": "\ud800.safetensors"}, "'\\ud800.safetensors'"),
    (["model-00001-of-00002.safetensors"], "a 'weight_map' of ['model-00001"),
    ("model.safetensors", "a 'weight_map' of 'model.safetensors'"),
])
def test_a_malformed_weight_map_is_one_line_naming_the_index(weight_map: Any, fragment: str, sharded: Path,
                                                             tmp_path: Path, cli_in_process):
    source = _with_weight_map(sharded, tmp_path, weight_map)
    assert_refused_without_a_run(cli_in_process("import", source, "--run", tmp_path / "run"), tmp_path, INDEX,
                                 fragment)
