"""`nanopt eval RUN1 RUN2`: the model.json and train.json settings that differ between the compared runs, as each
checkpoint was trained, in a table (a note when none differ); keys that change neither what a run learns nor what
it costs, and a dataset named by another path, are not differences; values from the run directories are shown
as text, never as markup or terminal control."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from faulthelp import Launcher
from trainhelp import make_run

from nanopt.evaluate.settings_diff import differences, shown

SHORT = {"max_steps": 2, "checkpoint_interval": 2, "eval_interval": 0}
ODD_NAME = "[red]odd\x1bname"  # markup and an ESC in a dataset's directory name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> dict[str, Path]:
    """`base`; `hot`: a three times larger learning rate and one layer fewer, logging at another interval and its
    dataset named relative to the run; `odd`: base reading the same dataset through a link with an odd name."""
    root = tmp_path_factory.mktemp("runs")
    link = root / ODD_NAME
    link.symlink_to(tiny_dataset, target_is_directory=True)
    found = {"base": make_run(root, tiny_dataset, "base", **SHORT),
             "hot": make_run(root, tiny_dataset, "hot", model={"num_hidden_layers": 1}, learning_rate=9e-3,
                             log_interval=2, data=os.path.relpath(tiny_dataset, root / "hot"), **SHORT),
             "odd": make_run(root, link, "odd", **SHORT)}
    for run in found.values():
        launcher.train(run)
    return found


def _compare(cli, *runs: Path, as_json: bool = False):
    result = cli("eval", *runs, "--tokens", "256", "--no-samples", *(["--json"] if as_json else []))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout) if as_json else result.stdout


def test_the_settings_that_differ_are_shown(runs, cli_in_process):
    compared = _compare(cli_in_process, runs["base"], runs["hot"], as_json=True)
    order = [row["run"] for row in compared["runs"]]
    layers, rate = ([1 if run == str(runs["hot"]) else 2 for run in order],
                    [9e-3 if run == str(runs["hot"]) else 3e-3 for run in order])
    assert compared["settings_differ"] == [{"setting": "model.json num_hidden_layers", "values": layers},
                                           {"setting": "train.json learning_rate", "values": rate}]
    table = _compare(cli_in_process, runs["base"], runs["hot"])
    assert "settings that differ, as trained" in table
    rows = [line for line in table.splitlines() if "json " in line]
    assert len(rows) == 2 and "num_hidden_layers" in rows[0] and "learning_rate" in rows[1]
    assert "0.009" in rows[1] and "0.003" in rows[1]
    assert "log_interval" not in table and "json data" not in table


def test_a_note_says_when_no_setting_differs(runs, cli_in_process):
    copy = shutil.copytree(runs["base"], runs["base"].parent / "copy")
    table = _compare(cli_in_process, runs["base"], copy)
    assert "settings: the runs were trained with the same model.json and train.json" in table
    assert "settings that differ" not in table


def test_values_from_a_run_are_shown_as_text(runs, cli_in_process):
    table = _compare(cli_in_process, runs["base"], runs["odd"])
    row = next(line for line in table.splitlines() if "train.json data" in line)
    assert "[red]odd\\x1bname" in row  # the markup as typed, the ESC made visible
    assert "\x1b" not in table


def test_values_read_as_typed():
    assert [shown(v) for v in (6e-4, 1.8e-3, 5e-05, 524288, True, None, "wsd")] == \
        ["0.0006", "0.0018", "5e-05", "524,288", "true", "null", "wsd"]
    assert shown(0.1 + 0.2) != shown(0.3)  # two values that differ never read alike
    assert shown({"web": 0.7, "code": 0.3}) == '{"code": 0.3, "web": 0.7}'
    assert len(shown("x" * 500)) == 80
    assert shown("a\nb\x1b") == "a\\nb\\x1b"  # a line break would split the table's row


def test_seq_len_left_to_the_model_is_the_models_positions():
    def result(run: str, seq_len: int | None) -> dict:
        return {"run": run, "config": {"model": {"max_position_embeddings": 32},
                                       "train": {"data": "../data", "seq_len": seq_len}}}

    assert differences([result("runs/a", None), result("runs/b", 32)]) == []
    assert differences([result("runs/a", None), result("runs/b", 16)]) == [
        {"setting": "train.json seq_len", "values": [32, 16]}]


def test_a_reused_result_without_its_config_is_unknown_not_different():
    def result(run: str, learning_rate: float | None) -> dict:
        if learning_rate is None:  # an eval.json written before results carried their config, reused as it is
            return {"run": run}
        return {"run": run, "config": {"model": {"hidden_size": 32},
                                       "train": {"data": "../data", "learning_rate": learning_rate}}}

    assert differences([result("runs/a", 3e-3), result("runs/old", None)]) == []
    assert differences([result("runs/a", 3e-3), result("runs/old", None), result("runs/b", 9e-3)]) == [
        {"setting": "train.json learning_rate", "values": [3e-3, "?", 9e-3]}]
