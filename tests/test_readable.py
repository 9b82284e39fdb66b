"""Output people can read and config people can write : the run comparison at 80 columns and
through a pipe, no library log lines around nanopt's own, `--version`, every boolean flag as `--x/--no-x`, token
counts such as `5M` in train.json and `--set`, and `--set` of one budget key replacing the other."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer.main
from clihelp import REPO, assert_user_error
from faulthelp import Launcher, tiny_run

from nanopt.cli import app
from nanopt.cli.display.format import money
from nanopt.cli.terminal import PIPED_WIDTH
from nanopt.config import load_run

# ------------------------------------------------------------------------------------------- the comparison


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> list[Path]:
    """Two tiny trained runs whose names tell them apart only at their end."""
    root = tmp_path_factory.mktemp("compare")
    runs = [tiny_run(root, tiny_dataset, name, max_steps=steps, eval_interval=0, checkpoint_interval=steps)
            for name, steps in (("lr-sweep-baseline", 4), ("lr-sweep-warmup", 2))]
    for run in runs:
        launcher.train(run)
    return runs


def comparison_cells(row: dict) -> list[str]:
    """What a person reads off the comparison for one run, written here from the --json numbers."""
    return [row["run"], f"{row['step']:,}", f"{row['test_loss']:.4f}", f"{row['bits_per_byte']:.4f}",
            f"{row['global_batch_tokens']:,}", money(row["cost_usd"]), f"{row['gpu_hours']:.2f}"]


@pytest.mark.parametrize("columns", ["80", None], ids=["COLUMNS=80", "no terminal"])
def test_the_comparison_is_whole_at_80_columns_and_in_a_log_file(compared, cli_in_process, monkeypatch,
                                                                 columns: str | None):
    monkeypatch.chdir(compared[0].parent)  # run names as people type them: relative to where they are
    args = ["eval", *(run.name for run in compared), "--tokens", "256", "--no-samples", "--price-per-hour", "2.99"]
    data = cli_in_process(*args, "--json")
    assert data.returncode == 0, data.stderr[-3000:]
    assert data.stderr == ""  # a progress bar on a stderr that is no terminal left an empty line behind
    rows = json.loads(data.stdout)["runs"]
    assert {"run", "step", "parameters", "tokens_trained", "global_batch_tokens", "test_loss", "perplexity",
            "bits_per_byte", "train_seconds", "gpu_hours", "cost_usd", "settings"} <= rows[0].keys()  # all in --json

    if columns is None:
        # No stream is a terminal here, as in `nanopt eval ... > eval.log 2>&1` under nohup: no width to fit but
        # nanopt's own for logs (`| less` from a terminal gets the terminal's width, from stderr).
        monkeypatch.delenv("COLUMNS")
    else:
        monkeypatch.setenv("COLUMNS", columns)
    table = cli_in_process(*args)
    assert table.returncode == 0, table.stderr[-3000:]
    lines = table.stdout.splitlines()
    width = PIPED_WIDTH if columns is None else int(columns)
    assert all(len(line) <= width for line in lines), table.stdout
    if columns is None:  # in a log's width the comparison is one table (at 80 columns, several, each with the rank)
        assert any("test loss" in line and "w/o eval" in line for line in lines), table.stdout
    assert "…" not in table.stdout, table.stdout  # nothing cut short
    words = set(table.stdout.replace("│", " ").replace("┃", " ").split())
    for row in rows:
        for cell in comparison_cells(row):
            assert cell in words, (cell, table.stdout)  # each value whole, on one line
    assert "test loss" in table.stdout and "bits/byte" in table.stdout


# ------------------------------------------------------------------------------------ library log lines


def test_the_profiler_prints_nothing_of_its_own(compared, launcher: Launcher):
    """torch's profiler (kineto) wrote `USDT: ... profiler_start` lines straight to stderr, and torch a UserWarning
    with its source line for --warmup 0."""
    result = launcher.run("profile", compared[0], "--wait", "0", "--warmup", "0", "--steps", "1",
                          "--no-tensorboard", "--json", "--out", compared[0].parent / "profile-quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["schedule"]["active"] == 1
    assert result.stderr.strip() == "", result.stderr


def test_a_mistake_is_the_only_line_when_stderr_is_no_terminal(compared, launcher: Launcher):
    result = launcher.run("profile", compared[0], "--steps", "0")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, repr(result.stderr)


def test_hugging_face_library_warnings_are_quiet_while_nanopt_runs():
    """The hub's retry warnings ("'...' thrown while requesting HEAD ...", "Retrying in 1s") and `datasets`' logged
    read errors came before nanopt's own one-line error. nanopt keeps them quiet for its own run only (the hub is
    imported here first, as a program embedding nanopt may have)."""
    from datasets.utils import logging as datasets_logging
    from huggingface_hub.utils import logging as hub_logging

    from nanopt.cli.app import quiet_libraries

    loggers = [hub_logging.get_logger("huggingface_hub.utils._http"), datasets_logging.get_logger("datasets.x")]
    assert all(logger.isEnabledFor(logging.WARNING) for logger in loggers)
    with quiet_libraries():
        assert not any(logger.isEnabledFor(logging.ERROR) for logger in loggers)
    assert all(logger.isEnabledFor(logging.WARNING) for logger in loggers)  # the libraries' own settings again


# ------------------------------------------------------------------------------------------ --version


def test_version_is_printed_fast_without_torch():
    probe = ("import sys\nfrom nanopt.cli import main\n"
             "for flag in ('--version', '-V'):\n"
             "    try:\n        main([flag])\n    except SystemExit as exc:\n        print('exit', exc.code)\n"
             "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"nanopt {version('nanopt')}", "exit 0"] * 2 + ["False"]
    assert result.stderr == ""


# ------------------------------------------------------------------------------------------ boolean flags


def boolean_flags() -> list[tuple[str, str, list[str]]]:
    """(command, the flag's name without dashes or "no-", its spellings) for every boolean option of every command."""
    group = typer.main.get_command(app)
    return [(name, param.opts[0].removeprefix("--").removeprefix("no-"), [*param.opts, *param.secondary_opts])
            for name, command in group.commands.items() for param in command.params
            if getattr(param, "is_bool_flag", False)]


def test_every_boolean_flag_reads_both_ways(cli_in_process):
    flags = boolean_flags()
    assert {("tokenize", "force"), ("eval", "samples"), ("train", "live"), ("eval", "json")} <= {
        (command, name) for command, name, _ in flags}
    for command, name, spellings in flags:
        assert sorted(spellings) == sorted([f"--{name}", f"--no-{name}"]), (command, spellings)
    for command in {command for command, _, _ in flags}:
        both = [f"--{prefix}{name}" for c, name, _ in flags if c == command for prefix in ("", "no-")]
        # Every spelling parses (an unknown option is a usage error before --help is looked at); --help shows them.
        result = cli_in_process(command, *both, "--help")
        assert result.returncode == 0, (command, result.stderr)
        assert all(flag in result.stdout for flag in both), (command, both, result.stdout)


def test_a_boolean_flag_takes_effect_either_way(cli_in_process):
    with_json = cli_in_process("estimate", REPO / "runs" / "gpt2-small", "--no-json", "--json")
    assert json.loads(with_json.stdout)["params"] == 124_475_904
    table = cli_in_process("estimate", REPO / "runs" / "gpt2-small", "--json", "--no-json")
    assert table.returncode == 0 and "124,475,904" in table.stdout and not table.stdout.startswith("{")


# ------------------------------------------------------------------------------------ token counts, budget


def small_run(tmp_path: Path, **train: object) -> Path:
    """A run directory for load_run and estimate (no dataset needed): seq_len 16, one micro-batch of 64 tokens."""
    run = tmp_path / "run"
    run.mkdir()
    model = {"architecture": "llama", "vocab_size": 512, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16}
    (run / "model.json").write_text(json.dumps(model))
    (run / "train.json").write_text(json.dumps({"data": "data", "micro_batch_size": 4, **train}))
    return run


def test_token_counts_are_written_as_people_write_them(tmp_path: Path, cli_in_process):
    run = small_run(tmp_path, global_batch_tokens="1.024k", train_tokens="2.5M", eval_tokens="64k")
    train = load_run(run).train
    assert (train.global_batch_tokens, train.train_tokens, train.eval_tokens) == (1024, 2_500_000, 64_000)
    report = json.loads(cli_in_process("estimate", run, "--set", "train_tokens=5M", "--json").stdout)
    assert report["optimizer_steps"] == math.ceil(5_000_000 / 1024)
    assert json.loads(cli_in_process("estimate", run, "--set", "train_tokens=20e6", "--json").stdout)[
        "optimizer_steps"] == math.ceil(20_000_000 / 1024)


def test_an_unreadable_token_count_names_the_file_and_the_key(tmp_path: Path, cli_in_process):
    run = small_run(tmp_path, global_batch_tokens=1024, train_tokens="2.5X")
    assert_user_error(cli_in_process("estimate", run), "train.json", "'train_tokens'", "2.5X", "2.5B")
    assert_user_error(cli_in_process("estimate", run, "--set", "train_tokens=1.5"), "'train_tokens'",
                      "whole number")
    assert_user_error(cli_in_process("estimate", run, "--set", "train_tokens=5M", "--set", "eval_tokens=-3k"),
                      "'eval_tokens'")


def test_setting_one_budget_key_replaces_the_other_from_train_json(tmp_path: Path, cli_in_process):
    by_steps = small_run(tmp_path, global_batch_tokens=1024, max_steps=10)
    tokens = json.loads(cli_in_process("estimate", by_steps, "--set", "train_tokens=5M", "--json").stdout)
    assert tokens["optimizer_steps"] == math.ceil(5_000_000 / 1024)
    (tmp_path / "run" / "train.json").write_text(json.dumps(
        {"data": "data", "micro_batch_size": 4, "global_batch_tokens": 1024, "train_tokens": "5M"}))
    steps = json.loads(cli_in_process("estimate", by_steps, "--set", "max_steps=7", "--json").stdout)
    assert steps["optimizer_steps"] == 7
    # Both from the command line: nothing to choose between, so the one-line error stays.
    assert_user_error(cli_in_process("estimate", by_steps, "--set", "max_steps=7", "--set", "train_tokens=1M"),
                      "exactly one of 'train_tokens' and 'max_steps'")
