"""Run health for a run someone did not watch: `nanopt eval RUN --health` and eval.json's `health` section.

Replays the run's metrics.jsonl (finished, or still being written: a torn last line is skipped) through the
monitor training uses (nanopt.train.health.verdicts), and draws its signals against steps into RUN/health.png.

Memory is bounded whatever the file's length (a long GPU run logs millions of lines), and time is linear in it:
the file is read once, a line at a time (a line over 1 MiB is skipped unread, nanopt.train.observe.records); the monitor
keeps four windows of blocks and ratios (a few thousand numbers at most); the chart keeps each curve thinned as it is
read to at most CHART_BUCKETS runs of points, each run's lowest and highest (nanopt.train.observe.metrics.Thinned), for
at most MAX_CURVES curves. Measured on two cores: a peak of 414 MB for 1,000 lines (the interpreter, torch and
matplotlib), 442 MB for a million, 430 MB for ten million, at about 21 s per million lines; the tests hold the
peak within 100 MB of the 1,000 lines' one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.config import RunConfig, load_run
from nanopt.config.load import model_config_from_snapshot, train_config_from_snapshot
from nanopt.data.mixtures.mixture import open_run_data
from nanopt.errors import NanoptError
from nanopt.rundir import RunDir
from nanopt.train.checkpoint.meta import read_meta
from nanopt.train.checkpoint.read import complete_checkpoints
from nanopt.train.health.verdicts import STAGNANT_RATIO, HealthMonitor, HealthSettings
from nanopt.train.health.window import Block
from nanopt.train.observe.metrics import Thinned, iter_metrics, new_figure, save_chart

MAX_CURVES = 64  # gradient-norm blocks or update-ratio groups charted: a stranger's file may name millions


def run_health(run: RunConfig) -> dict[str, Any]:
    """The health section: verdicts (recorded, and reached by the train records) and the latest signals."""
    return _replay(run, None).summary()


def _replay(run: RunConfig, chart: HealthCurves | None) -> HealthMonitor:
    monitor = HealthMonitor(HealthSettings.from_run(run, token_rows=_data_id_limit(run)))
    for record in iter_metrics(run.run_dir):
        monitor.read(record)
        if chart is not None:
            chart.add(record)
    return monitor


def _data_id_limit(run: RunConfig) -> int | None:
    """The token ids the run's data holds, which training built the model's softmax over (None when the data is
    gone: the first loss is then judged against every row of the vocabulary)."""
    try:
        return open_run_data(run, verify_up_to_bytes=0).id_limit
    except NanoptError:
        return None


def health_report(run_dir: Path, chart: bool = True) -> dict[str, Any]:
    """A run's health section with its chart (None before the first train record)."""
    run = _as_trained(load_run(run_dir))
    curves = HealthCurves() if chart else None
    report = {"run": str(run_dir), **_replay(run, curves).summary(), "chart": None}
    if curves is not None and curves.records:
        report["chart"] = str(save_chart(health_figure(curves, report["verdicts"], run_dir),
                                         RunDir(run_dir).health_chart))
    return report


def _as_trained(run: RunConfig) -> RunConfig:
    """The run as its newest checkpoint was trained: a `--set max_steps=...` or an edit of train.json since changes
    the run's length, and with it the window the verdicts are judged over, as training judged them (eval.json's
    section already comes from the checkpoint it scores). train.json's when there is no usable checkpoint yet."""
    newest = complete_checkpoints(run.run_dir)[-1:]
    if not newest:
        return run
    try:
        config = read_meta(newest[0] / "meta.json")["config"]
        model = model_config_from_snapshot(config["model"], "config.model")
        train = train_config_from_snapshot(config["train"], model, "config.train")
    except (NanoptError, KeyError, TypeError):  # damaged or foreign: its run is judged by train.json
        return run
    return RunConfig(run_dir=run.run_dir, model=model, train=train)


class HealthCurves:
    """The chart's curves, each thinned as the train records are read (nanopt.train.observe.metrics.Thinned)."""

    def __init__(self) -> None:
        self.loss, self.grad_norm, self.clipped = Thinned(), Thinned(), Thinned()
        self.records = 0
        self.blocks: dict[str, Thinned] = {}
        self.groups: dict[str, Thinned] = {}

    def add(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if record.get("kind") != "train" or type(step) is not int:
            return
        self.records += 1
        self.loss.add(step, record.get("loss"))
        self.grad_norm.add(step, record.get("grad_norm"))
        _add_each(self.blocks, step, record.get("grad_norm_blocks"))
        _add_each(self.groups, step, record.get("update_ratio"))
        blocks = record.get("health_blocks")
        if isinstance(blocks, list):  # the share of each block's steps clipped
            for block in filter(None, map(Block.from_record, blocks)):
                self.clipped.add(block.last, block.clipped / block.steps)
        else:  # a run older than blocks: the share since the last logged step
            self.clipped.add(step, record.get("clipped_fraction"))


def _add_each(curves: dict[str, Thinned], step: int, values: Any) -> None:
    if not isinstance(values, dict):
        return
    for name, value in values.items():
        if name not in curves and len(curves) >= MAX_CURVES:
            continue
        curves.setdefault(name, Thinned()).add(step, value)


def health_figure(curves: HealthCurves, verdicts: list[dict[str, Any]], run_dir: Path) -> Any:
    """Loss, gradient norms (global and per block), update ratios per group and the share of steps clipped,
    against steps; each verdict a vertical line."""
    fig = new_figure(figsize=(10, 10), dpi=100, layout="constrained")
    axes = fig.subplots(4, 1, sharex=True)
    axes[0].plot(*curves.loss.points(), linewidth=1)
    axes[0].set_ylabel("loss")
    axes[1].plot(*curves.grad_norm.points(), color="black", linewidth=1.2, label="global")
    for block, curve in curves.blocks.items():
        axes[1].plot(*curve.points(), linewidth=0.7, alpha=0.7, label=block)
    axes[1].set_ylabel("gradient norm")
    axes[1].set_yscale("log")
    for group, curve in curves.groups.items():
        axes[2].plot(*curve.points(), linewidth=1, label=group)
    axes[2].axhline(STAGNANT_RATIO, color="tab:red", linestyle=":", linewidth=1, label="stagnating")
    axes[2].set_ylabel("update / parameter")
    axes[2].set_yscale("log")
    axes[3].plot(*curves.clipped.points(), linewidth=1)
    axes[3].set_ylabel("share clipped")
    axes[3].set_ylim(-0.05, 1.05)
    axes[3].set_xlabel("step")
    for ax in axes:
        for v in verdicts:
            ax.axvline(v["step"], color="tab:orange", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # beside the panel, never over its curves
            ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    names = ", ".join(f"{v['name']} (step {v['step']})" for v in verdicts) or "no verdict"
    axes[0].set_title(f"{Path(run_dir).name}: {names}", fontsize="small")
    return fig
