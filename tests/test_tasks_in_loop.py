"""train.json's downstream_tasks: scored at each in-loop evaluation into metrics.jsonl's eval records, inside the
eval phase; a task that cannot be loaded is turned off with a warning and the run goes on; a misspelt task is
one line before training starts."""

from __future__ import annotations

import json
from pathlib import Path

from clihelp import assert_user_error
from faulthelp import Launcher
from taskdata import write_task_data
from trainhelp import make_run


def test_tasks_are_scored_at_each_eval_and_a_missing_one_is_skipped(tmp_path: Path, tiny_dataset: Path,
                                                                     launcher: Launcher):
    data = write_task_data(tmp_path / "tasks")
    (data / "hellaswag.jsonl").unlink()  # cannot be loaded: off with a warning, training goes on
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=4, eval_interval=2, checkpoint_interval=4,
                   eval_tokens=256, downstream_tasks="piqa,hellaswag,lambada_openai",
                   downstream_task_data=str(data), downstream_examples=1)
    child = launcher.train(run)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "downstream task hellaswag is off" in child.stdout + child.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 0.0 <= r["task_piqa_acc"] <= 1.0 and r["task_lambada_openai_perplexity"] > 1.0
        assert "task_centered_mean" in r and not any(k.startswith("task_hellaswag") for k in r)


def test_a_misspelt_task_is_one_line_before_training(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=2, downstream_tasks="piqa,mmlu")
    assert_user_error(launcher.run("train", run, "--no-live"), "train.json: key 'downstream_tasks'",
                      "unknown task 'mmlu'")
    assert not (run / "checkpoints").exists()
