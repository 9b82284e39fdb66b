"""`nanopt eval RUN --tasks ...` end to end on a tiny trained run, with --task-data files (no network): the table,
eval.json's tasks section, two runs side by side, and the mistakes a user can make."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import Launcher
from taskdata import RECORDS, write_task_data
from trainhelp import make_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    root = tmp_path_factory.mktemp("task-runs")
    run = make_run(root, tiny_dataset, "run", max_steps=4, eval_interval=0, checkpoint_interval=4)
    launcher.train(run)
    return run


@pytest.fixture(scope="module")
def task_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_task_data(tmp_path_factory.mktemp("task-data") / "tasks")


def test_every_task_is_scored_and_recorded(trained: Path, task_data: Path, cli_in_process):
    result = cli_in_process("eval", trained, "--tasks", "all", "--task-data", task_data, "--no-samples",
                            "--tokens", "2k", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    saved = json.loads((trained / "eval.json").read_text())
    assert saved["tasks"] == out["tasks"] and saved["settings"]["tasks"]["names"] == list(RECORDS)
    for name, records in RECORDS.items():
        task = out["tasks"][name]
        assert task["n"] == len(records) and 0.0 <= task["acc"]["value"] <= 1.0, name
    assert "acc_norm" in out["tasks"]["hellaswag"] and "acc_norm" not in out["tasks"]["winogrande"]
    assert out["tasks"]["lambada_openai"]["perplexity"] > 1.0
    # max_position_embeddings is 32: HellaSwag's long contexts were cut on the left.
    assert out["tasks"]["hellaswag"]["truncated"] > 0
    assert isinstance(out["centered_mean"], float)


def test_two_runs_side_by_side_with_a_limit(trained: Path, task_data: Path, cli_in_process):
    other = shutil.copytree(trained, trained.parent / "copy")
    result = cli_in_process("eval", trained, other, "--tasks", "piqa,winogrande", "--limit", "1", "--task-data",
                            task_data, "--no-samples", "--tokens", "2k", "--fresh")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "downstream tasks" in result.stdout and "piqa (n=1)" in result.stdout
    assert f"{other} @ 4" in result.stdout and "centered" in result.stdout


def test_a_comparison_reuses_a_runs_task_scores_whole(trained: Path, task_data: Path, cli_in_process):
    """Scores reused from an earlier evaluation (the checkpoint's eval.json) are what was measured, every field."""
    other = shutil.copytree(trained, trained.parent / "reused")
    args = ("--tasks", "all", "--task-data", task_data, "--no-samples", "--tokens", "2k", "--json")
    first = cli_in_process("eval", other, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    compared = cli_in_process("eval", other, trained, *args)
    assert compared.returncode == 0, compared.stderr[-3000:]
    [again] = [r for r in json.loads(compared.stdout)["runs"] if r["run"] == str(other)]
    fresh = json.loads(first.stdout)
    assert again["reused"] and again["tasks"] == fresh["tasks"] and again["centered_mean"] == fresh["centered_mean"]
    assert again["test_loss"] == fresh["test_loss"] and again["bits_per_byte"] == fresh["bits_per_byte"]


def test_tasks_without_a_test_loss_need_no_dataset(trained: Path, task_data: Path, cli_in_process):
    result = cli_in_process("eval", trained, "--no-loss", "--no-samples", "--tasks", "lambada_openai",
                            "--task-data", task_data, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["tasks"]["lambada_openai"]["n"] == 2


def test_mistakes_are_one_line(trained: Path, task_data: Path, tmp_path: Path, cli_in_process, launcher: Launcher):
    assert_user_error(cli_in_process("eval", trained, "--tasks", "mmlu"), "unknown task 'mmlu'")
    assert_user_error(cli_in_process("eval", trained, "--limit", "5"), "no --tasks was given")
    assert_user_error(cli_in_process("eval", trained, "--tasks", "piqa", "--task-data", tmp_path, "--no-samples"),
                      "piqa.jsonl: task file not found")
    # No hub (offline, empty cache): one line that says what to do instead.
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    assert_user_error(launcher.run("eval", trained, "--tasks", "piqa", "--no-samples", "--no-loss", env=offline),
                      "piqa: could not load baber/piqa", "--task-data")


def test_a_missing_task_file_is_found_before_any_checkpoint_is_read(tiny_dataset: Path, tmp_path: Path,
                                                                    cli_in_process):
    """`--tasks all` with one task's file missing: one line at once, not after the model was loaded and the tasks
    before it were scored. The run has no checkpoint at all: only a check made first can report the task file."""
    task_data = write_task_data(tmp_path / "tasks")
    (task_data / "piqa.jsonl").unlink()
    (task_data / "winogrande.jsonl").unlink()
    run = make_run(tmp_path, tiny_dataset, "untrained")
    result = cli_in_process("eval", run, "--tasks", "all", "--task-data", task_data, "--no-samples")
    assert_user_error(result, f"{task_data / 'piqa.jsonl'}: task file not found (nor winogrande's)", "--task-data")
