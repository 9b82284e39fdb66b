"""`nanopt eval RUN --harness TASKS`: lm-evaluation-harness run by nanopt on the exported checkpoint, its numbers
in eval.json beside nanopt's and in the same table; without the `harness` extra, one line saying how to install
it (a real process in which `import lm_eval` fails, tests/no_harness)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clihelp import REPO, assert_user_error
from faulthelp import Launcher
from taskdata import RECORDS, write_task_data
from trainhelp import make_run

NO_HARNESS = REPO / "tests" / "no_harness"  # a sitecustomize that makes `import lm_eval` fail (test-only)


def test_without_the_extra_it_says_how_to_install_it(tmp_path: Path, tiny_dataset: Path):
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=2)
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{NO_HARNESS}", "CUDA_VISIBLE_DEVICES": "", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "nanopt", "eval", run, "--harness", "piqa"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert_user_error(result, "--harness runs lm-evaluation-harness, which is not installed",
                      'pip install "nanopt[harness]"')
    assert not (run / "eval.json").exists()


def test_harness_mistakes_are_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    pytest.importorskip("lm_eval")
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=2)
    assert_user_error(cli_in_process("eval", run, "--harness", "mmlu"), "--harness: unknown task 'mmlu'")
    assert_user_error(cli_in_process("eval", run, "--harness", "piqa", "--nproc-per-node", "2"),
                      "--harness runs lm-evaluation-harness in one process")
    assert_user_error(cli_in_process("eval", run, "--harness", "piqa", "--task-data", tmp_path),
                      "piqa.jsonl: task file not found")


@pytest.mark.slow
def test_harness_numbers_go_beside_nanopts(tmp_path: Path, tiny_dataset: Path, launcher: Launcher,
                                           cli_in_process):
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=4, eval_interval=0, checkpoint_interval=4)
    assert launcher.train(run).returncode == 0
    task_data = write_task_data(tmp_path / "tasks")
    result = cli_in_process("eval", run, "--tasks", "all", "--harness", "all", "--limit", "1", "--task-data",
                            task_data, "--no-samples", "--tokens", "2k")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((run / "eval.json").read_text())
    assert set(saved["harness"]) == set(RECORDS) and saved["harness_seconds"] > 0
    assert saved["settings"]["harness"] == {"names": list(RECORDS), "limit": 1, "task_data": str(task_data)}
    for name in RECORDS:
        ours, theirs = saved["tasks"][name], saved["harness"][name]
        assert theirs["n"] == ours["n"] == 1, name
        assert theirs["acc"]["value"] == ours["acc"]["value"], name  # the differential test holds them equal
    assert saved["harness"]["lambada_openai"]["perplexity"] == pytest.approx(
        saved["tasks"]["lambada_openai"]["perplexity"], rel=1e-4)
    # The table has a column of the harness's numbers; its progress bars stay off stdout.
    assert "(harness)" in result.stdout and "lm-evaluation-harness" in result.stdout, result.stdout
    assert "loglikelihood requests" not in result.stdout and "loglikelihood requests" in result.stderr
