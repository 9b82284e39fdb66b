"""train.json's `data` is relative to the run directory, so a run works from any working directory: the trap a new
user hit when `nanopt eval` from another directory could not find the dataset `nanopt train` had used."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import tiny_run


@pytest.fixture
def project(tmp_path: Path, tiny_dataset: Path) -> Path:
    """project/data/tiny and project/runs/r, whose train.json says "data": "../../data/tiny"."""
    shutil.copytree(tiny_dataset, tmp_path / "data" / "tiny")
    run = tiny_run(tmp_path / "runs", tiny_dataset, "r", max_steps=4, checkpoint_interval=4, eval_interval=0)
    train = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**train, "data": "../../data/tiny"}))
    return tmp_path


def test_train_eval_and_export_find_the_dataset_from_any_working_directory(project: Path, cli_in_process,
                                                                           monkeypatch: pytest.MonkeyPatch):
    elsewhere = project / "runs"
    monkeypatch.chdir(elsewhere)  # neither the project root nor the run directory
    trained = cli_in_process("train", "r")
    assert trained.returncode == 0, trained.stderr
    monkeypatch.chdir(project.parent)
    evaluated = cli_in_process("eval", project / "runs" / "r", "--tokens", "512", "--no-samples", "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert Path(json.loads(evaluated.stdout)["dataset"]).resolve() == (project / "data" / "tiny").resolve()
    exported = cli_in_process("export", project / "runs" / "r")
    assert exported.returncode == 0, exported.stderr
    assert (project / "runs" / "r" / "export" / "tokenizer.json").is_file()


def test_a_missing_dataset_names_the_path_it_looked_at(project: Path, cli_in_process,
                                                       monkeypatch: pytest.MonkeyPatch):
    shutil.rmtree(project / "data")
    monkeypatch.chdir(project)
    result = cli_in_process("train", "runs/r")
    assert_user_error(result, "error: data/tiny: dataset directory not found", "'../../data/tiny'",
                      "--out data/tiny")  # the path it looked at, folded: not runs/r/../../data/tiny
    assert not (project / "runs" / "r" / "checkpoints").exists()


def test_a_path_written_from_the_project_root_gets_the_corrected_value_as_hint(project: Path, cli_in_process,
                                                                                monkeypatch: pytest.MonkeyPatch):
    """A train.json written before data paths were relative to the run directory: "data/tiny" meant from the
    project root. The error says where the dataset is and what to write instead."""
    train_json = project / "runs" / "r" / "train.json"
    train_json.write_text(json.dumps({**json.loads(train_json.read_text()), "data": "data/tiny"}))
    monkeypatch.chdir(project)
    result = cli_in_process("train", "runs/r")
    assert_user_error(result, "runs/r/data/tiny", '"../../data/tiny"')


def test_train_and_eval_show_a_dataset_path_alike_relative_and_folded(project: Path, cli_in_process,
                                                                      monkeypatch: pytest.MonkeyPatch):
    """However the dataset was named (train.json's "../../data/tiny", `--set data=` made absolute, `--data` with a
    `..`), a message shows the path one way: folded, and relative to the current directory under it."""
    monkeypatch.chdir(project)
    assert cli_in_process("train", "runs/r").returncode == 0  # a checkpoint for eval
    (project / "data" / "tiny" / "train" / "shard-00000.npy").unlink()
    for argv in (["train", "runs/r"], ["train", "runs/r", "--set", "data=data/tiny"], ["eval", "runs/r"],
                 ["eval", "runs/r", "--data", "runs/r/../../data/tiny"], ["eval", project / "runs" / "r"]):
        result = cli_in_process(*argv, "--no-live" if argv[0] == "train" else "--no-samples")
        assert_user_error(result, "error: data/tiny/train/shard-00000.npy: shard file not found")
    # From inside runs/, the dataset is outside the current directory: absolute, however it was named.
    monkeypatch.chdir(project / "runs")
    outside = f"error: {project / 'data' / 'tiny' / 'train' / 'shard-00000.npy'}: shard file not found"
    for argv in (["train", "r"], ["train", "r", "--set", "data=../data/tiny"], ["eval", "r"],
                 ["eval", "r", "--data", "../data/tiny"]):
        result = cli_in_process(*argv, "--no-live" if argv[0] == "train" else "--no-samples")
        assert_user_error(result, outside)


def test_set_data_is_relative_to_the_current_directory(project: Path, cli_in_process,
                                                       monkeypatch: pytest.MonkeyPatch):
    """A path typed on the command line means what it means in the shell."""
    shutil.move(project / "data" / "tiny", project / "moved")
    monkeypatch.chdir(project)
    result = cli_in_process("train", "runs/r", "--set", "data=moved")
    assert result.returncode == 0, result.stderr
    meta = json.loads(next((project / "runs" / "r" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["config"]["train"]["data"] == os.path.abspath(project / "moved")
    # A --set path that is not there is the command line's mistake, not train.json's (which holds no such path).
    for data in ("typo", '{"web": {"path": "typo", "weight": 1}}'):
        missing = cli_in_process("train", "runs/r", "--set", f"data={data}")
        assert_user_error(missing, "typo: dataset directory not found (--set data: relative to the current "
                          "directory)", "correct --set data")
        assert "train.json" not in missing.stderr


def test_a_mixture_set_on_the_command_line_is_relative_to_the_current_directory(project: Path, cli_in_process,
                                                                                  monkeypatch: pytest.MonkeyPatch):
    """`--set 'data={...}'` is typed in a shell too: its paths mean what `--set data=DIR` means, in both forms of
    a mixture (keyed by name, with a path; keyed by the path), and a path-keyed source keeps its name."""
    shutil.copytree(project / "data" / "tiny", project / "data" / "copy")
    monkeypatch.chdir(project)
    mixture = json.dumps({"web": {"path": "data/tiny", "weight": 3}, "data/copy": 1})
    result = cli_in_process("train", "runs/r", "--no-live", "--set", f"data={mixture}")
    assert result.returncode == 0, result.stderr
    meta = json.loads(next((project / "runs" / "r" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["config"]["train"]["data"] == {"web": {"path": str(project / "data" / "tiny"), "weight": 3},
                                               "data/copy": {"path": str(project / "data" / "copy"), "weight": 1}}


def test_resume_after_the_dataset_moved(project: Path, cli_in_process, monkeypatch: pytest.MonkeyPatch):
    """The dataset's contents are what a resume must not change; its path may (a new disk, a new machine)."""
    monkeypatch.chdir(project)
    assert cli_in_process("train", "runs/r").returncode == 0
    shutil.move(project / "data" / "tiny", project / "elsewhere")
    train_json = project / "runs" / "r" / "train.json"
    train = json.loads(train_json.read_text())
    train_json.write_text(json.dumps({**train, "data": "../../elsewhere", "max_steps": 6}))
    result = cli_in_process("train", "runs/r", "--allow-changed")  # for max_steps; the moved data needs nothing
    assert result.returncode == 0, result.stderr
    assert "resumed" in (result.stdout + result.stderr).lower()
