"""`nanopt eval --no-loss`: the heading of each run says what follows it (samples, downstream tasks, or both), and
what it says is what is shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from faulthelp import Launcher
from taskdata import write_task_data
from trainhelp import make_run

SAMPLE = ("--prompt", "The", "--max-new-tokens", "2")
TASKS = ("--tasks", "piqa", "--limit", "1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    run = make_run(tmp_path_factory.mktemp("runs"), tiny_dataset, "run", max_steps=2, eval_interval=0,
                   checkpoint_interval=2)
    launcher.train(run)
    return run


@pytest.fixture(scope="module")
def task_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_task_data(tmp_path_factory.mktemp("task-data") / "tasks")


@pytest.mark.parametrize(("options", "heading", "samples", "tasks"), [
    ((*TASKS, "--no-samples"), "downstream tasks only (--no-loss: no test loss)", False, True),
    (SAMPLE, "samples only (--no-loss: no test loss)", True, False),
    ((*TASKS, *SAMPLE), "samples and downstream tasks (--no-loss: no test loss)", True, True),
], ids=["tasks", "samples", "both"])
def test_the_heading_names_what_is_shown(options, heading, samples, tasks, trained, task_data, cli_in_process):
    task_files = ("--task-data", task_data) if tasks else ()
    result = cli_in_process("eval", trained, "--no-loss", *task_files, *options)
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"nanopt eval: {trained} at step 2: {heading}; tokenizer: "), first
    assert (f"{trained}: 'The'" in result.stdout) == samples  # a sample's panel
    assert ("downstream tasks, zero-shot" in result.stdout) == tasks  # the tasks' table
    assert not (trained / "eval.json").exists()  # no test loss, no eval.json
