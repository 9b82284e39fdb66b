"""model.json / train.json validation: every mistake is one line naming the file and key, exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from clihelp import REPO, assert_user_error, run_cli

from nanopt.config import load_run
from nanopt.errors import ConfigError
from nanopt.parsing import parse_overrides


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(REPO / "runs" / "gpt2-small", target)
    return target


def edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


DELETE = object()

MODEL_MISTAKES = [
    ({"hidden_sizee": 768}, "unknown key 'hidden_sizee'", "did you mean 'hidden_size'"),
    ({"hidden_size": "768"}, "key 'hidden_size'", "integer"),
    ({"num_hidden_layers": 12.5}, "key 'num_hidden_layers'", "integer"),
    ({"tie_word_embeddings": 1}, "key 'tie_word_embeddings'", "true or false"),
    ({"architecture": "mamba"}, "key 'architecture'", "llama"),
    ({"num_attention_heads": 10}, "key 'num_attention_heads'", "does not divide"),
    ({"vocab_size": 0}, "key 'vocab_size'", "positive"),
    ({"vocab_size": DELETE}, "missing required key 'vocab_size'", "model.json"),
    ({"dropout": 1.5}, "key 'dropout'", "[0, 1)"),
    ({"num_key_value_heads": 4}, "key 'num_key_value_heads'", "gpt2"),
]

TRAIN_MISTAKES = [
    ({"learning_rate": "fast"}, "key 'learning_rate'", "number"),
    ({"lr_schedule": "linear"}, "key 'lr_schedule'", "cosine"),
    ({"micro_batch_size": -4}, "key 'micro_batch_size'", "positive"),
    ({"max_steps": 100}, "exactly one of 'train_tokens' and 'max_steps'", "train.json"),
    ({"seq_len": 4096}, "key 'seq_len'", "max_position_embeddings"),
    ({"global_batch_tokens": 1000}, "key 'global_batch_tokens'", "smaller than one micro-batch"),
    ({"parallelism": "tensor"}, "key 'parallelism'", "ddp"),
    ({"beta2": 1.0}, "key 'beta2'", "[0, 1)"),
    ({"compile": "yes"}, "key 'compile'", "auto"),
    ({"tf32": "off"}, "key 'tf32'", "true or false"),
]


@pytest.mark.parametrize("changes,fragment,detail", MODEL_MISTAKES)
def test_model_json_mistakes_are_one_line_errors(run_dir: Path, changes, fragment, detail):
    edit(run_dir / "model.json", **changes)
    with pytest.raises(ConfigError) as info:
        load_run(run_dir)
    line = info.value.one_line()
    assert "model.json" in line and fragment in line and detail in line, line


@pytest.mark.parametrize("changes,fragment,detail", TRAIN_MISTAKES)
def test_train_json_mistakes_are_one_line_errors(run_dir: Path, changes, fragment, detail):
    edit(run_dir / "train.json", **changes)
    with pytest.raises(ConfigError) as info:
        load_run(run_dir)
    line = info.value.one_line()
    assert "train.json" in line and fragment in line and detail in line, line


def test_malformed_json_names_line_and_column(run_dir: Path):
    (run_dir / "model.json").write_text('{"architecture": "gpt2",\n "vocab_size": 50257,,}')
    with pytest.raises(ConfigError, match=r"model.json: malformed JSON at line 2 column"):
        load_run(run_dir)


def test_cli_reports_config_mistake_with_exit_2_and_no_traceback(run_dir: Path):
    edit(run_dir / "model.json", num_attention_heads=7)
    assert_user_error(run_cli("estimate", run_dir), "model.json", "num_attention_heads")


def test_cli_missing_run_directory(tmp_path: Path):
    assert_user_error(run_cli("estimate", tmp_path / "nope"), "run directory not found")


def test_set_overrides_train_json_for_one_invocation(run_dir: Path):
    before = (run_dir / "train.json").read_text()
    run = load_run(run_dir, parse_overrides(["learning_rate=3e-4", "lr_schedule=wsd", "max_steps=10",
                                             "train_tokens=null"]))
    assert run.train.learning_rate == 3e-4 and run.train.lr_schedule == "wsd" and run.total_steps == 10
    assert (run_dir / "train.json").read_text() == before  # nothing written


def test_set_with_unknown_key_names_the_override(run_dir: Path):
    result = run_cli("estimate", run_dir, "--set", "learning_rat=1e-3")
    assert_user_error(result, "unknown key 'learning_rat'", "--set", "did you mean 'learning_rate'")


@pytest.mark.parametrize("command", ["train", "estimate"])
def test_set_with_a_model_json_key_says_to_edit_model_json(run_dir: Path, command: str, cli_in_process):
    before = sorted(p.name for p in run_dir.iterdir())
    live = ["--no-live"] if command == "train" else []
    result = cli_in_process(command, run_dir, "--set", "vocab_size=1024", *live)
    assert_user_error(result, "--set vocab_size=1024: vocab_size is a key of model.json",
                      "--set changes train.json only", f'edit {run_dir / "model.json"}: "vocab_size": 1024')
    assert "known keys" not in result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before  # nothing written


def test_set_without_equals_sign():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["learning_rate"])


def test_derived_values(run_dir: Path):
    run = load_run(run_dir)
    assert run.model.head_dim == 64
    assert run.seq_len == 1024  # defaults to max_position_embeddings
    assert run.grad_accum_steps(1) == 524288 // (16 * 1024)
    assert run.grad_accum_steps(8) == 4
    assert run.total_steps == -(-run.train.train_tokens // run.train.global_batch_tokens)


def test_inexact_grad_accum_suggests_values_that_work(run_dir: Path):
    run = load_run(run_dir, parse_overrides(["micro_batch_size=12"]))
    with pytest.raises(ConfigError) as info:
        run.grad_accum_steps(1)
    line = info.value.one_line()
    assert "524288" in line and "12 x 1024 x 1" in line
    # every suggested micro_batch_size really divides the global batch
    suggested = line.split("micro_batch_size ")[-1]
    sizes = [int(s) for s in suggested.replace(" or ", " ").split() if s.isdigit()]
    assert sizes and all(524288 % (m * 1024) == 0 for m in sizes)


def test_underscore_keys_are_comments(run_dir: Path):
    edit(run_dir / "model.json", _why="documentation, ignored")
    assert load_run(run_dir).model.hidden_size == 768


def test_every_preset_loads():
    for run_dir in sorted((REPO / "runs").iterdir()):
        run = load_run(run_dir)
        assert run.total_steps > 0
        run.grad_accum_steps(1)  # every preset's batch divides exactly on one GPU
