"""train.json's downstream_tasks: scored every downstream_interval steps (at in-loop evaluations, and at the last
step) into metrics.jsonl's eval records, TensorBoard, the loss chart and the end-of-run table, inside the eval
phase; a task that cannot be loaded (a missing file, a bad file) is turned off with a warning and the run goes on;
a misspelt task or an interval that is no multiple of eval_interval is one line before training starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import Launcher
from taskdata import write_task_data
from trainhelp import make_run


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def test_tasks_are_scored_every_downstream_interval_and_a_bad_one_is_skipped(tmp_path: Path, tiny_dataset: Path,
                                                                             launcher: Launcher):
    pytest.importorskip("tensorboard")
    data = write_task_data(tmp_path / "tasks")
    (data / "hellaswag.jsonl").unlink()  # cannot be loaded: off with a warning, training goes on
    (data / "arc_easy.jsonl").write_text('{"id": "x", "question": "Why?"\n')  # a bad file: not JSON
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=6, eval_interval=2, checkpoint_interval=6,
                   eval_tokens=256, downstream_tasks="piqa,hellaswag,arc_easy,lambada_openai",
                   downstream_task_data=str(data), downstream_examples=1, downstream_interval=4, tensorboard=True)
    child = launcher.train(run)
    assert child.returncode == 0, child.stderr[-3000:]
    said = child.stdout + child.stderr
    assert "downstream task hellaswag is off" in said and "downstream task arc_easy is off" in said
    evals = _records(run, "eval")
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert not any(k.startswith("task_") for k in evals[0])  # step 2: no multiple of downstream_interval 4
    for r in evals[1:]:  # step 4, and step 6: the last step always scores
        assert 0.0 <= r["task_piqa_acc"] <= 1.0 and r["task_lambada_openai_perplexity"] > 1.0
        assert "task_centered_mean" in r and not any(k.startswith(("task_hellaswag", "task_arc")) for k in r)
        assert 0 < r["downstream_s"] <= r["eval_s"]  # charged to the eval phase
    # The phase table's eval time holds the tasks' time.
    assert _records(run, "phases")[-1]["seconds"]["eval"] >= sum(r["downstream_s"] for r in evals[1:])
    # TensorBoard gets them; so does the end-of-run table.
    from test_sinks import tensorboard_scalars

    shown = tensorboard_scalars(run / "tensorboard")
    assert sorted(shown["eval/task_piqa_acc"]) == [4, 6] and "eval/task_centered_mean" in shown
    assert "downstream tasks (step 6)" in said and "piqa acc" in said and "lambada_openai acc" in said


def test_the_loss_chart_draws_task_accuracy(tmp_path: Path):
    from nanopt.train.observe.metrics import MetricsLog, loss_chart

    run = tmp_path / "run"
    run.mkdir()
    log = MetricsLog(run, enabled=True)  # the records training writes, as it writes them
    for step in range(1, 9):
        log.write("train", step=step, tokens=64 * step, loss=5.0 - step / 10)
        if step % 4 == 0:
            log.write("eval", step=step, tokens=64 * step, val_loss=5.0, task_hellaswag_acc=0.25,
                      task_hellaswag_acc_norm=0.5 * step / 8, task_winogrande_acc=0.5, task_centered_mean=0.0)
    fig = loss_chart(run)
    right = fig.axes[1]
    assert right.get_ylabel() == "downstream accuracy (%)"
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in right.lines}
    assert lines == {"hellaswag acc_norm": ([256, 512], [25.0, 50.0]), "winogrande acc": ([256, 512], [50.0, 50.0])}


def test_mistakes_are_one_line_before_training(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=2, downstream_tasks="piqa,mmlu")
    assert_user_error(launcher.run("train", run, "--no-live"), "train.json: key 'downstream_tasks'",
                      "unknown task 'mmlu'")
    assert_user_error(launcher.run("train", run, "--no-live", "--set", "downstream_tasks=piqa", "--set",
                                   "downstream_interval=7"),
                      "key 'downstream_interval': 7 is not a multiple of eval_interval 5")
    assert not (run / "checkpoints").exists()


def test_the_cost_warning_spreads_the_tasks_time_over_their_interval():
    """Tasks every 8 steps, evaluation every 2: each evaluation weighs 1 s of loss plus a quarter of the tasks' 4 s,
    whether it scored them or not, so the warning judges every interval alike."""
    from types import SimpleNamespace

    from nanopt.train.downstream import typical_eval_seconds

    def session(step: int, eval_s: float) -> SimpleNamespace:
        train = SimpleNamespace(eval_interval=2, downstream_interval=8)
        return SimpleNamespace(run=SimpleNamespace(train=train), state=SimpleNamespace(step=step, val_step=step),
                               clock=SimpleNamespace(last={"eval": eval_s}), downstream_last=(8, 4.0))

    assert typical_eval_seconds(session(8, 5.0)) == pytest.approx(2.0)  # scored now: 1 s + 4 s / 4
    assert typical_eval_seconds(session(10, 1.0)) == pytest.approx(2.0)  # not scored now: 1 s + 4 s / 4


def test_the_eta_charges_the_tasks_to_the_scorings_left_not_to_every_evaluation():
    """Evaluation every 2 steps (1 s of loss), tasks every 8 (4 s), 32 steps: at step 10 the evaluations at 12, 14,
    ..., 32 are left (11), and the scorings at 16, 24 and 32 (3). The latest evaluation's 5 s (step 8, with tasks)
    charged to all 11 would be 55 s; its 1 s (step 10 already evaluated, without) would forget the tasks."""
    from types import SimpleNamespace

    from nanopt.train.downstream import tasks_seconds_left

    def session(step: int, val_step: int, eval_s: float) -> SimpleNamespace:
        train = SimpleNamespace(eval_interval=2, downstream_interval=8)
        return SimpleNamespace(run=SimpleNamespace(train=train), state=SimpleNamespace(step=step, val_step=val_step),
                               total_steps=32, clock=SimpleNamespace(last={"eval": eval_s}), downstream_last=(8, 4.0))

    assert tasks_seconds_left(session(10, 8, 5.0)) == pytest.approx((1.0, 12.0))  # the log line before step 10's
    assert tasks_seconds_left(session(11, 10, 1.0)) == pytest.approx((1.0, 12.0))
    no_tasks = SimpleNamespace(**{**vars(session(10, 8, 5.0)), "downstream_last": None})
    assert tasks_seconds_left(no_tasks) == (5.0, 0.0)


def test_the_gpt2_presets_tasks_without_the_hub_are_turned_off_and_training_goes_on(tmp_path: Path,
                                                                                     tiny_dataset: Path,
                                                                                     launcher: Launcher):
    from clihelp import REPO

    preset = json.loads((REPO / "runs" / "gpt2-small" / "train.json").read_text())
    assert preset["downstream_tasks"] == "hellaswag,arc_easy,piqa" and preset["downstream_examples"] <= 500
    assert preset["downstream_interval"] % preset["eval_interval"] == 0  # the preset itself is valid
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=2, eval_interval=2, checkpoint_interval=2,
                   eval_tokens=256, downstream_tasks=preset["downstream_tasks"],
                   downstream_examples=preset["downstream_examples"])
    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    child = launcher.train(run, env=offline)
    assert child.returncode == 0, child.stderr[-3000:]
    said = child.stdout + child.stderr
    for name, dataset in (("hellaswag", "Rowan/hellaswag"), ("arc_easy", "allenai/ai2_arc"), ("piqa", "baber/piqa")):
        assert f"downstream task {name} is off for this session: {name}: could not load {dataset}" in said
    (evaluation,) = _records(run, "eval")
    assert evaluation["step"] == 2 and not any(k.startswith("task_") for k in evaluation)
    assert (run / "checkpoints" / "step-000002").is_dir()


def test_with_evaluation_off_a_downstream_interval_needs_no_edit():
    """`--set eval_interval=0` on the GPT-2 preset (as the GPU session's runs do) scores nothing, tasks included: its
    downstream_interval of 1000 is then no mistake. A negative one still is."""
    from clihelp import REPO

    from nanopt.config import load_run
    from nanopt.errors import ConfigError

    run = load_run(REPO / "runs" / "gpt2-small", {"eval_interval": 0})
    assert run.train.downstream_interval == 1000 and run.train.eval_interval == 0
    with pytest.raises(ConfigError, match="'downstream_interval': must not be negative"):
        load_run(REPO / "runs" / "gpt2-small", {"downstream_interval": -5})
