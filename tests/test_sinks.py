"""TensorBoard and W&B logging (train.json `tensorboard`, `wandb_project`) read back against metrics.jsonl, a sink
that fails, a missing package; the loss chart's event marks and `nanopt eval RUN1 RUN2 --chart`."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from clihelp import assert_user_error
from faulthelp import tiny_run

pytest.importorskip("tensorboard")  # the `dev` extra installs both; a bare install skips rather than fails

# 8 steps, a line each, an evaluation and a checkpoint every 4: a second or two on a CPU.
SHORT = {"max_steps": 8, "log_interval": 1, "eval_interval": 4, "checkpoint_interval": 4, "keep_checkpoints": 5}


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """What TensorBoard shows: every scalar tag, by step, after it drops the points a resume purged."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    shown = {}
    for tag in acc.Tags()["scalars"]:
        points = acc.Scalars(tag)
        shown[tag] = {e.step: e.value for e in points}
        if tag.startswith(("train/", "eval/")):  # one record per step (phases and events may come several times)
            assert len(shown[tag]) == len(points), (tag, [e.step for e in points])  # drawn twice: not purged
    return shown


def test_tensorboard_scalars_equal_metrics_jsonl_step_by_step_across_a_resume(tmp_path, tiny_dataset,
                                                                              cli_in_process):
    run = tiny_run(tmp_path, tiny_dataset, "tb", tensorboard=True, **SHORT)
    assert cli_in_process("train", run).returncode == 0
    # From the step-4 checkpoint again: metrics.jsonl drops steps 5-8 and writes them anew (their tokens/s differ),
    # and TensorBoard must show the new values only.
    assert cli_in_process("train", run, "--resume", "step-000004").returncode == 0

    shown = tensorboard_scalars(run / "tensorboard")
    train, evals = records(run, "train"), records(run, "eval")
    assert [r["step"] for r in train] == list(range(1, 9))
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tokens", "epoch", "elapsed_s"):
        assert shown[f"train/{field}"] == {r["step"]: np.float32(r[field]) for r in train}, field
    for field in ("val_loss", "val_perplexity", "eval_s"):
        assert shown[f"eval/{field}"] == {r["step"]: np.float32(r[field]) for r in evals}, field
    assert sorted(shown["eval/val_loss"]) == [4, 8]
    assert "phases/seconds/train" in shown


def _wandb_records(path: Path):
    """The records of an offline W&B run's transaction log (`run-ID.wandb`: LevelDB's log format of 32 KiB
    blocks, after a 7-byte file header), as W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts.append(chunk)
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.mark.slow  # W&B starts a service process of its own
def test_wandb_offline_run_holds_the_history_and_the_final_loss(tmp_path, tiny_dataset, launcher):
    pytest.importorskip("wandb")
    run = tiny_run(tmp_path, tiny_dataset, "wb", wandb_project="nanopt-test", **SHORT)
    wandb_dir = tmp_path / "wandb-home"
    wandb_dir.mkdir()
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_CONFIG_DIR": str(wandb_dir),
           "WANDB_CACHE_DIR": str(wandb_dir), "WANDB_DATA_DIR": str(wandb_dir), "WANDB_API_KEY": ""}
    # A process of its own (forked from the warm launcher): W&B's run ends with the process, as in training.
    result = launcher.run("train", run, env=env)
    assert result.status == 0, result.stderr

    logs = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, logs
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in _wandb_records(logs[0]) if r.WhichOneof("record_type") == "history"]
    logged = {h["step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert logged == {r["step"]: r["loss"] for r in records(run, "train")}
    assert {h["step"]: h["eval/val_loss"] for h in history if "eval/val_loss" in h} == {
        r["step"]: r["val_loss"] for r in records(run, "eval")}
    assert any(h.get("event", "").startswith("checkpoint at step 8") for h in history)


def test_wandb_is_online_with_a_key_and_offline_without_one_saying_where(tmp_path, tiny_dataset, monkeypatch):
    from nanopt.config import load_run
    from nanopt.train.observe.sinks import wandb_mode

    run = load_run(tiny_run(tmp_path, tiny_dataset, "modes", wandb_project="nanopt", **SHORT))
    (tmp_path / "netrc").write_text("")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no `wandb login` either
    mode, note = wandb_mode(run)
    assert mode == "offline" and f"logging offline into {run.run_dir / 'wandb'}" in note
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k\n")
    assert wandb_mode(run) == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B's own variable: W&B reads it
    assert wandb_mode(run) == (None, None)
    forced = load_run(run.run_dir, {"wandb_mode": "offline"})
    assert wandb_mode(forced) == ("offline", None)


def test_a_sink_that_fails_warns_once_and_the_run_completes(tmp_path, tiny_dataset, cli_in_process):
    run = tiny_run(tmp_path, tiny_dataset, "broken", tensorboard=True, **SHORT)
    (run / "tensorboard").write_text("a file where TensorBoard's directory goes\n")
    result = cli_in_process("train", run)
    assert result.returncode == 0, result.stderr
    said = result.stdout + result.stderr
    assert said.count("TensorBoard logging stopped") == 1, said
    assert "Traceback" not in said
    assert [r["step"] for r in records(run, "train")] == list(range(1, 9))
    assert [r["step"] for r in records(run, "eval")] == [4, 8]
    assert (run / "tensorboard").read_text() == "a file where TensorBoard's directory goes\n"


@pytest.mark.parametrize("key, value, package", [("tensorboard", True, "tensorboard"),
                                                 ("wandb_project", "nanopt", "wandb")])
def test_a_missing_package_is_refused_before_training(tmp_path, tiny_dataset, cli_in_process, monkeypatch,
                                                      key, value, package):
    run = tiny_run(tmp_path, tiny_dataset, "missing", **{key: value, **SHORT})
    monkeypatch.setitem(sys.modules, package, None)  # `import tensorboard` fails, as without the package
    result = cli_in_process("train", run)
    assert_user_error(result, f"'{key}'", f"{package} is not installed", f"pip install 'nanopt[{package}]'")
    assert not (run / "metrics.jsonl").exists()
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize("name", ["", "team/project", "x" * 129])
def test_a_bad_wandb_project_name_is_refused(tmp_path, tiny_dataset, cli_in_process, name):
    run = tiny_run(tmp_path, tiny_dataset, "badname", wandb_project=name, **SHORT)
    assert_user_error(cli_in_process("estimate", run), "'wandb_project'", "not a W&B project name")


# ------------------------------------------------------------------------------------------------------- charts


def test_the_loss_chart_marks_recoveries_and_loss_spikes(tmp_path):
    from matplotlib.image import imread

    from nanopt.train.observe.metrics import MetricsLog, loss_chart, write_loss_chart

    run = tmp_path / "marked"
    run.mkdir()
    log = MetricsLog(run, enabled=True)  # the records training writes, as it writes them
    for step in range(1, 31):
        log.write("train", step=step, tokens=64 * step, loss=5.0 - step / 10)
        if step % 10 == 0:
            log.write("eval", step=step, tokens=64 * step, val_loss=5.1 - step / 10)
    log.write("event", step=12, event="loss_spike", loss=9.0, zscore=8.0)
    log.write("event", step=13, event="loss_spike", loss=9.5, zscore=9.0)
    log.write("event", step=14, event="recovery", to_step=10, lr_factor=0.5)
    log.write("event", step=20, event="checkpoint", path="step-000020")  # not marked

    fig = loss_chart(run)
    ax = fig.axes[0]
    verticals = [line for line in ax.lines if line.get_linestyle() in ("--", ":")]
    assert sorted(line.get_xdata()[0] for line in verticals) == [64 * 12, 64 * 13, 64 * 14]  # at the events' steps
    assert {line.get_color() for line in verticals if line.get_xdata()[0] == 64 * 14} == {"tab:red"}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "train", "val", "loss spike: 2 times", "recovery (rolled back): once"]

    path = write_loss_chart(run)
    assert path == run / "loss.png"
    assert imread(path).shape == (495, 880, 4)  # 8 x 4.5 inches at 110 dpi


CHART_IN_A_NOTEBOOK = r"""
import sys
from pathlib import Path
import matplotlib
matplotlib.use("svg")  # the backend a person chose before calling nanopt's charts
import matplotlib.pyplot as plt
from nanopt.evaluate.charts import comparison_figure
from nanopt.train.observe.metrics import MetricsLog, write_loss_chart

run = Path(sys.argv[1])
log = MetricsLog(run, enabled=True)
for step in range(1, 11):
    log.write("train", step=step, tokens=64 * step, loss=5.0 - step / 10)
log.close()
write_loss_chart(run)
comparison_figure([run], ["run"])
print(matplotlib.get_backend(), len(plt.get_fignums()))
"""


def test_drawing_a_chart_leaves_the_processes_matplotlib_as_it_was(tmp_path):
    # A person who calls these from a notebook keeps the backend they chose, and finds no figure of nanopt's in
    # pyplot's list, which would hold it until closed.
    run = tmp_path / "run"
    run.mkdir()
    result = subprocess.run([sys.executable, "-c", CHART_IN_A_NOTEBOOK, str(run)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "0"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

def _train_two_runs(root: Path, dataset: Path, cli) -> list[Path]:
    runs = [tiny_run(root, dataset, name, learning_rate=lr, **SHORT) for name, lr in (("slow", 1e-3), ("fast", 1e-2))]
    for run in runs:
        assert cli("train", run).returncode == 0
    return runs


def test_eval_of_several_runs_overlays_their_loss_curves_on_one_png(tmp_path, tiny_dataset, cli_in_process):
    from matplotlib.image import imread

    from nanopt.evaluate.charts import check_chart_path, comparison_figure

    runs = _train_two_runs(tmp_path, tiny_dataset, cli_in_process)
    result = cli_in_process("eval", *runs, "--no-samples", "--tokens", "512")
    assert result.returncode == 0, result.stderr
    chart = tmp_path / "compare.png"  # the default: beside the first run
    assert f"chart: {chart}" in result.stdout
    assert imread(chart).shape == (550, 990, 4)  # 9 x 5 inches at 110 dpi

    fig = comparison_figure(runs, ["slow", "fast"])
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].lines}
    assert sorted(lines) == ["fast test", "fast train", "fast val", "slow test", "slow train", "slow val"]
    for run, name in zip(runs, ["slow", "fast"], strict=True):
        tested = json.loads((run / "eval.json").read_text())  # the eval above, from the run's eval_history.jsonl
        assert lines[f"{name} test"] == ([tested["tokens_trained"]], [tested["test_loss"]])
        assert lines[f"{name} train"] == ([r["tokens"] for r in records(run, "train")],
                                          [r["loss"] for r in records(run, "train")])
        assert lines[f"{name} val"][1] == [r["val_loss"] for r in records(run, "eval")]

    # Its own chart may be replaced; a file nanopt did not draw is refused, before any evaluation.
    check_chart_path(chart)
    photo = tmp_path / "holiday.png"
    photo.write_bytes(chart.read_bytes().replace(b"nanopt", b"camera"))
    before = photo.read_bytes()
    assert_user_error(cli_in_process("eval", *runs, "--chart", photo), "--chart", "not a chart nanopt drew")
    assert photo.read_bytes() == before
