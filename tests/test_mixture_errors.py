"""A bad data mixture in train.json, or datasets that cannot be mixed: one line, exit 2, nothing written, before any
step (tests/test_mixture.py has what a good one does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error
from conftest import TINY_SETTINGS
from faulthelp import tree_digest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mixturehelp import mixture
from trainhelp import make_run

from nanopt.config import load_run


@pytest.fixture
def sources(mixture_sources: dict[str, Path]) -> dict[str, Path]:
    return mixture_sources


_EXTREMES = st.sampled_from([10**400, -(10**400), 2**63, 0, -1, 0.0, 1e-320, float("nan"), float("inf"), "decay"])
_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), _EXTREMES),
                     lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3)),
                     max_leaves=8)
_SOURCE = st.one_of(_JSON, st.fixed_dictionaries({"path": _JSON, "weight": _JSON}))
_PHASE = st.one_of(_JSON, st.fixed_dictionaries({"from": st.one_of(_JSON, st.just("decay")),
                                                 "mixture": st.dictionaries(st.sampled_from(["a", "b", "c"]), _JSON,
                                                                            max_size=3)}))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(st.sampled_from(["a", "b", "", " ", "data/x"]), _SOURCE, max_size=3),
       phases=st.one_of(st.none(), st.lists(_PHASE, max_size=3)))
@example(data={"a": 10**400}, phases=None)
@example(data={"a": {"path": "x", "weight": -(10**400)}}, phases=None)
@example(data={"a": 1, "b": 2}, phases=[{"from": 10**400, "mixture": {"a": 1}}])
@example(data={"a": 1, "b": 2}, phases=[{"from": float("inf"), "mixture": {"b": 10**400}}])
def test_any_mixture_is_taken_or_refused_in_one_line(tmp_path: Path, sources: dict[str, Path], data, phases):
    """Whatever `data` and `data_phases` hold, loading the run gives a config or one ConfigError line that names
    train.json, never another exception."""
    from nanopt.errors import ConfigError

    run = tmp_path / "fuzz"
    if not run.exists():
        make_run(tmp_path, sources["web"], "fuzz")
    config = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**config, "data": data, "data_phases": phases}))
    try:
        loaded = load_run(run)
    except ConfigError as error:
        assert "\n" not in error.message and "train.json" in error.message, error.message
        return
    assert loaded.mixture is not None and len(loaded.mixture.sources) == len(data)


def _train_json(run: Path, **changes) -> None:
    config = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(("weights", "fragments"), [
    ({"web": -0.5, "code": 0.5}, ("source 'web'", "weight -0.5 is not positive")),
    ({"web": 0, "code": 1}, ("source 'web'", "weight 0 is not positive")),
    ({"web": "lots", "code": 1}, ("source 'web'", "weight 'lots' is not a number")),
    ({"web": float("nan"), "code": 1}, ("source 'web'", "is not a number")),
])
def test_a_bad_weight_is_one_line(tmp_path: Path, sources: dict[str, Path], cli_in_process, weights, fragments):
    run = make_run(tmp_path, sources["web"])
    _train_json(run, data={name: {"path": str(sources[name]), "weight": w} for name, w in weights.items()})
    assert_user_error(cli_in_process("train", run, "--no-live"), "train.json", "key 'data'", *fragments)
    assert tree_digest(run / "checkpoints") == {} and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize(("phases", "fragment"), [
    ([{"from": 1.5, "mixture": {"web": 1}}], "neither a fraction in (0, 1), a step >= 1, nor \"decay\""),
    ([{"from": 20, "mixture": {"web": 1}}], "'from' 20 is outside the run's steps 1 to 19"),
    ([{"from": "decay", "mixture": {"web": 1}}], "needs \"lr_schedule\": \"wsd\""),
    ([{"from": 0.5, "mixture": {"web": 1}}, {"from": 5, "mixture": {"code": 1}}], "not after data_phases[0]"),
    ([{"from": 0.5, "mixture": {"web": 0}}], "weight 0 is not positive"),
    ([{"from": 0.5}], "exactly 'from' and 'mixture'"),
])
def test_a_bad_phase_is_one_line(tmp_path: Path, sources: dict[str, Path], cli_in_process, phases, fragment):
    run = make_run(tmp_path, sources["web"], data=mixture(sources), data_phases=phases)
    assert_user_error(cli_in_process("train", run, "--no-live"), "train.json", "data_phases", fragment)
    assert not (run / "metrics.jsonl").exists()


def test_a_decay_phase_after_the_last_step_says_why(tmp_path: Path, sources: dict[str, Path], cli_in_process):
    # A warmup as long as the run leaves no decay to start a phase at: say which settings place it.
    run = make_run(tmp_path, sources["web"], data=mixture(sources), lr_schedule="wsd", warmup_steps=50,
                   data_phases=[{"from": "decay", "mixture": {"web": 1}}])
    assert_user_error(cli_in_process("train", run, "--no-live"), "data_phases[0]", "'decay' (step 20)",
                      "lower warmup_steps or raise decay_fraction")
    assert not (run / "metrics.jsonl").exists()


def test_phases_need_a_mixture(tmp_path: Path, sources: dict[str, Path], cli_in_process):
    run = make_run(tmp_path, sources["web"], data_phases=[{"from": 0.5, "mixture": {"web": 1}}])
    assert_user_error(cli_in_process("estimate", run), "key 'data_phases': phases need a mixture in 'data'")


def test_an_unknown_source_in_a_phase_is_one_line(tmp_path: Path, sources: dict[str, Path], cli_in_process):
    run = make_run(tmp_path, sources["web"], data=mixture(sources),
                   data_phases=[{"from": 0.8, "mixture": {"web": 1, "maths": 1}}])
    assert_user_error(cli_in_process("train", run, "--no-live"), "data_phases[0]", "unknown source 'maths'",
                      "web, code, math")
    assert not (run / "metrics.jsonl").exists()


def test_a_missing_source_is_one_line(tmp_path: Path, sources: dict[str, Path], cli_in_process):
    run = make_run(tmp_path, sources["web"], data={str(sources["web"]): 0.5, "../nowhere/code": 0.5})
    assert_user_error(cli_in_process("train", run, "--no-live"), "dataset directory not found",
                      "'../nowhere/code', relative to the run directory")
    assert not (run / "metrics.jsonl").exists()


def test_mismatched_tokenizers_are_one_line_naming_both(tmp_path: Path, sources: dict[str, Path], tiny_corpus: Path,
                                                        cli_in_process):
    from nanopt.data.tokenize.pipeline import build_dataset

    other = tmp_path / "other"
    build_dataset(other, str(tiny_corpus), **{**TINY_SETTINGS, "vocab_size": 300})
    run = make_run(tmp_path, sources["web"], data={str(sources["web"]): 0.5, str(other): 0.5})
    assert_user_error(cli_in_process("train", run, "--no-live"), f"{other}: tokenized with another tokenizer than "
                      f"{sources['web']}")
    assert not (run / "metrics.jsonl").exists()
