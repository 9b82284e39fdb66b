"""Property: whatever one field of a checkpoint's meta.json holds, reading the checkpoint the way train, eval and
export do ends in a NanoptError (one line, exit 2, or a skipped checkpoint) or in success; never in another
exception from torch, numpy, Python's random module or nanopt itself: a checkpoint may come from someone else
(docs/design.md, "The trust boundary"), and what it holds is refused in one line, never a library's crash.

hypothesis, derandomized and without an example database: for each top-level field of a real checkpoint's
meta.json (written by `nanopt train` on a tiny run), a value somewhere inside it is replaced (by a value of another
type, a boundary number, a neighbour of the value it had) or deleted, or an unknown key is added. The reader is
the real one, in this process: nanopt.train.checkpoint.verify, the snapshot read by eval and export, the weights
loaded into the snapshot's model, the resume check and nanopt.train.checkpoint.resume.load_checkpoint into a live
training session. NANOPT_FUZZ_EXAMPLES sets the examples per field (default 8).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from faulthelp import Launcher, tiny_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanopt.errors import NanoptError

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "8"))
PROPERTY = settings(derandomize=True, database=None, deadline=timedelta(seconds=30), max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FIELDS = ["format_version", "step", "tokens", "best_val_loss", "skipped_steps", "ranks", "recovery", "metrics",
          "world_size", "tied", "config", "data_fingerprint", "tokenizer_sha256", "eos_id",
          "optimizer_param_groups", "layout", "files", "device_type"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> dict[str, Any]:
    """A trained tiny run, a copy of its newest checkpoint to edit, and a live training session of the run."""
    from nanopt.config import load_run
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session

    root = tmp_path_factory.mktemp("meta-properties")
    run = tiny_run(root, tiny_dataset, "run", max_steps=2, checkpoint_interval=2, eval_interval=0)
    launcher.train(run)
    copy = Path(shutil.copytree(run / "checkpoints" / "step-000002", root / "copy"))
    meta = json.loads((copy / "meta.json").read_text())
    assert set(meta) == set(FIELDS), "a new meta.json field: add it to FIELDS"
    session = build_session(load_run(run), init_runtime("fp32"))
    return {"run": run, "copy": copy, "meta": meta, "session": session}


def read_as_nanopt_does(world: dict[str, Any]) -> None:
    from nanopt.evaluate.trained import run_config_from_snapshot
    from nanopt.model.transformer import Transformer
    from nanopt.train import checkpoint as ckpt
    from nanopt.train.checkpoint.resume import check_resumable, data_fingerprint, load_checkpoint

    session = world["session"]
    found = ckpt.verify(world["copy"])
    snapshot = run_config_from_snapshot(world["run"], found)  # eval and export
    ckpt.load_weights(Transformer(snapshot.model), found)
    check_resumable(found.meta, session.run, data_fingerprint(session.dataset), allow_changed=True)  # train
    load_checkpoint(session, found)


def places(value: Any, path: tuple = ()) -> list[tuple]:
    """Every place inside `value` (a key or an index), a long list by its ends and middle only."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += places(item, (*path, key))
    elif isinstance(value, list):
        indices = range(len(value)) if len(value) <= 6 else (0, 1, len(value) // 2, len(value) - 1)
        for index in indices:
            found += places(value[index], (*path, index))
    return found


def neighbours(value: Any) -> list[Any]:
    """Values a damaged or edited file could plausibly hold instead of `value`."""
    if isinstance(value, bool):
        return [not value, int(value)]
    if isinstance(value, int):
        return [value + 1, value - 1, -value - 1, value * 10**6, float(value)]
    if isinstance(value, float):
        return [-value, value * 1e6, value / 1e6, math.nan, int(value)]
    if isinstance(value, str):
        return ["", value[: len(value) // 2], value + "x", value.upper()]
    if isinstance(value, list):
        return [value[:-1], value + value[-1:], list(reversed(value)), []]
    if isinstance(value, dict):
        return [{}, {**value, "unknown": 1}, dict(list(value.items())[:-1])]
    return [0]


ODD = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6),
                st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**70, -(2**63), 10**400]),
                st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.5, 0.5, 1.5, 5e-324]),
                st.text(max_size=8), st.just("x" * 100_000), st.lists(st.integers(-3, 3), max_size=3),
                st.just({}), st.just({"a": [1]}))


def mutate(meta: dict, data: st.DataObject, field: str) -> dict:
    meta = json.loads(json.dumps(meta))
    path = data.draw(st.sampled_from(places(meta[field], (field,))), label="where")
    parent = meta
    for step in path[:-1]:
        parent = parent[step]
    key, current = path[-1], parent[path[-1]]
    action = data.draw(st.sampled_from(["replace", "neighbour", "delete", "add"]), label="action")
    if action == "delete":
        del parent[key]
    elif action == "add" and isinstance(current, dict):
        current[data.draw(st.text(min_size=1, max_size=8), label="key")] = data.draw(ODD, label="value")
    elif action == "neighbour":
        parent[key] = data.draw(st.sampled_from(neighbours(current)), label="value")
    else:
        parent[key] = data.draw(ODD, label="value")
    return meta


@pytest.mark.parametrize("field", FIELDS)
def test_any_value_of_a_meta_field_is_a_nanopt_error_or_reads(world: dict[str, Any], field: str):
    meta_path = world["copy"] / "meta.json"

    @PROPERTY
    @given(data=st.data())
    def case(data: st.DataObject) -> None:
        meta_path.write_text(json.dumps(mutate(world["meta"], data, field)))
        try:
            read_as_nanopt_does(world)
        except NanoptError:
            pass

    try:
        case()
    finally:
        meta_path.write_text(json.dumps(world["meta"]))
    read_as_nanopt_does(world)  # the untouched checkpoint still reads
