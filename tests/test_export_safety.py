"""`nanopt export --force` replaces an earlier export and nothing else.

Every refusal is one line with a hint, exit status 2, and the whole temporary tree (the run, its parent with
unrelated files, a dataset, the user's own directories) is byte-for-byte unchanged: every file, directory and link
under it is hashed before and after each attempt.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A 4-step run with one checkpoint (copied by each test, never changed itself)."""
    run = tiny_run(tmp_path_factory.mktemp("trained"), tiny_dataset, "run", max_steps=4, checkpoint_interval=4,
                   eval_interval=0)
    launcher.train(run)
    return run


@pytest.fixture
def project(tmp_path: Path, trained: Path, tiny_dataset: Path) -> Path:
    """A user's project: a run, a dataset, notes and directories of their own beside it."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "notes.txt").write_text("three weeks of experiment notes")
    shutil.copytree(trained, root / "runs" / "run")
    dataset = shutil.copytree(tiny_dataset, root / "data" / "tiny")
    # The run reads the copy, as it would in a real project.
    train_json = root / "runs" / "run" / "train.json"
    train_json.write_text(train_json.read_text().replace(str(tiny_dataset), str(dataset)))
    mine = root / "mine"
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"\x00" * 64)
    (root / "a-file.txt").write_text("not a directory")
    return root


def digest(root: Path) -> dict[str, str]:
    """Every entry under root: files by content, links by target, directories by existence."""
    out = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            out[key] = "link -> " + os.readlink(path)
        elif path.is_dir():
            out[key] = "dir"
        else:
            out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def export_files(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def refused(cli, tmp_path: Path, run: Path, out: Path | str, *fragments: str, force: bool = True) -> None:
    before = digest(tmp_path)
    result = cli("export", run, "--out", out, *(["--force"] if force else []))
    assert_user_error(result, *fragments)
    assert digest(tmp_path) == before


# ------------------------------------------------------------------------------------------------ refusals


def test_out_the_run_directory_itself_is_refused(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    refused(cli_in_process, tmp_path, run, run, "is the run directory")
    # The same directory spelled another way.
    refused(cli_in_process, tmp_path, run, run / "checkpoints" / "..", "is the run directory")
    refused(cli_in_process, tmp_path, run, run, "is the run directory", force=False)


@pytest.mark.parametrize("ancestor", ["runs", ".", ".."])
def test_an_ancestor_of_the_run_is_refused(ancestor: str, project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    refused(cli_in_process, tmp_path, run, project / ancestor, "contains the run directory")


def test_the_current_directory_and_its_ancestors_are_refused(project: Path, tmp_path: Path, cli_in_process,
                                                             monkeypatch: pytest.MonkeyPatch):
    run = project / "runs" / "run"
    earlier = project / "hf"
    assert cli_in_process("export", run, "--out", earlier).returncode == 0
    (earlier / "sub").mkdir()
    monkeypatch.chdir(earlier)
    refused(cli_in_process, tmp_path, run, ".", "is the current directory")
    monkeypatch.chdir(earlier / "sub")
    refused(cli_in_process, tmp_path, run, "..", "contains the current directory")


def test_a_dataset_is_refused(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    refused(cli_in_process, tmp_path, run, project / "data" / "tiny", "is a nanopt dataset")
    refused(cli_in_process, tmp_path, run, project / "data", "not a nanopt export")


def test_a_directory_that_is_not_an_export_is_refused(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    refused(cli_in_process, tmp_path, run, project / "mine", "not a nanopt export", "--force only replaces")
    refused(cli_in_process, tmp_path, run, run / "checkpoints", "not a nanopt export")
    refused(cli_in_process, tmp_path, run, project / "mine", "already exists and is not empty", force=False)


def test_an_export_with_files_of_the_users_is_refused(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    out = project / "hf"
    assert cli_in_process("export", run, "--out", out).returncode == 0
    (out / "README.md").write_text("my model card")
    refused(cli_in_process, tmp_path, run, out, "not a nanopt export", "README.md")


def test_a_file_and_a_link_are_refused(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    refused(cli_in_process, tmp_path, run, project / "a-file.txt", "is not a directory")
    refused(cli_in_process, tmp_path, run, project / "a-file.txt" / "hf", "is not a directory")
    earlier = project / "hf"
    assert cli_in_process("export", run, "--out", earlier).returncode == 0
    (project / "link").symlink_to(earlier)
    refused(cli_in_process, tmp_path, run, project / "link", "is a symbolic link")


# ---------------------------------------------------------------------------------------- what --force does


def test_force_replaces_an_earlier_export_and_only_it(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    out = project / "hf"
    assert cli_in_process("export", run, "--out", out).returncode == 0
    first = digest(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= export_files(out)

    refused(cli_in_process, tmp_path, run, out, "already exists", "--force", force=False)
    others = {k: v for k, v in digest(tmp_path).items() if not k.startswith("project/hf")}
    result = cli_in_process("export", run, "--out", out, "--force")
    assert result.returncode == 0, result.stderr
    assert digest(out) == first  # the same checkpoint exported again
    assert {k: v for k, v in digest(tmp_path).items() if not k.startswith("project/hf")} == others


def test_the_default_destination_is_replaced_with_force(project: Path, tmp_path: Path, cli_in_process):
    run = project / "runs" / "run"
    assert cli_in_process("export", run).returncode == 0
    assert cli_in_process("export", run, "--force").returncode == 0
    assert {"config.json", "model.safetensors"} <= export_files(run / "export")


def test_an_empty_directory_is_written_into(project: Path, cli_in_process):
    run = project / "runs" / "run"
    (project / "empty").mkdir()
    result = cli_in_process("export", run, "--out", project / "empty")
    assert result.returncode == 0, result.stderr
    assert {"config.json", "model.safetensors"} <= export_files(project / "empty")
