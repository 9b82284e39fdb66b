"""Run health for a run someone did not watch: `nanopt eval RUN --health` and eval.json's `health` section.

Replays the run's metrics.jsonl (finished, or still being written: a torn last line is skipped) through the
monitor training uses (nanopt.train.health), and draws its signals against steps into RUN/health.png.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.config import RunConfig, load_run
from nanopt.config.load import model_config_from_snapshot, train_config_from_snapshot
from nanopt.data.mixture import open_run_data
from nanopt.errors import NanoptError
from nanopt.rundir import RunDir
from nanopt.train.checkpoint.meta import read_meta
from nanopt.train.checkpoint.read import complete_checkpoints
from nanopt.train.health import STAGNANT_RATIO, HealthSettings, replay
from nanopt.train.metrics import read_metrics, save_chart


def run_health(run: RunConfig, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The health section: verdicts (recorded, and reached by the train records) and the latest signals."""
    records = read_metrics(run.run_dir) if records is None else records
    return replay(records, HealthSettings.from_run(run, token_rows=_data_id_limit(run))).summary()


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
    records = read_metrics(run.run_dir)
    report = {"run": str(run_dir), **run_health(run, records), "chart": None}
    if chart and any(r.get("kind") == "train" for r in records):
        report["chart"] = str(save_chart(health_figure(records, report["verdicts"], run_dir),
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
    except (NanoptError, KeyError, TypeError):  # damaged or foreign: its run is judged by train.json, as before
        return run
    return RunConfig(run_dir=run.run_dir, model=model, train=train)


def _series(train: list[dict[str, Any]], key: str, inner: str | None = None) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key] if inner is None else (r.get(key) or {}).get(inner)) for r in train]
    kept = [(s, v) for s, v in points if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return [s for s, _ in kept], [v for _, v in kept]


def health_figure(records: list[dict[str, Any]], verdicts: list[dict[str, Any]], run_dir: Path) -> Any:
    """Loss, gradient norms (global and per block), update ratios per group and the share of steps clipped,
    against steps; each verdict a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("step"), int)]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), dpi=100, sharex=True)
    axes[0].plot(*_series(train, "loss"), linewidth=1)
    axes[0].set_ylabel("loss")
    axes[1].plot(*_series(train, "grad_norm"), color="black", linewidth=1.2, label="global")
    blocks = list(dict.fromkeys(k for r in train for k in (r.get("grad_norm_blocks") or {})))
    for block in blocks:
        axes[1].plot(*_series(train, "grad_norm_blocks", block), linewidth=0.7, alpha=0.7, label=block)
    axes[1].set_ylabel("gradient norm")
    axes[1].set_yscale("log")
    groups = list(dict.fromkeys(k for r in train for k in (r.get("update_ratio") or {})))
    for group in groups:
        axes[2].plot(*_series(train, "update_ratio", group), linewidth=1, label=group)
    axes[2].axhline(STAGNANT_RATIO, color="tab:red", linestyle=":", linewidth=1, label="stagnating")
    axes[2].set_ylabel("update / parameter")
    axes[2].set_yscale("log")
    axes[3].plot(*_series(train, "clipped_fraction"), linewidth=1)
    axes[3].set_ylabel("share clipped")
    axes[3].set_ylim(-0.05, 1.05)
    axes[3].set_xlabel("step")
    for ax in axes:
        for v in verdicts:
            ax.axvline(v["step"], color="tab:orange", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="x-small", ncol=4)
    names = ", ".join(f"{v['name']} (step {v['step']})" for v in verdicts) or "no verdict"
    axes[0].set_title(f"{Path(run_dir).name}: {names}", fontsize="small")
    fig.tight_layout()
    return fig
