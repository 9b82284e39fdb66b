"""Several runs on one chart: `nanopt eval RUN1 RUN2 ...` overlays their train and validation loss against tokens,
from each run's metrics.jsonl, and the test loss of each checkpoint evaluated (eval_history.jsonl: `nanopt eval`,
`eval --watch`), so a person sees the difference instead of reading it.

The PNG is written only over a missing file or a chart nanopt drew (marked in the PNG's `Software` text): a
`--chart` that names anything else is refused before any evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError
from nanopt.evaluate.history import loss_by_tokens, read_history
from nanopt.train.observe.metrics import CHART_SOFTWARE, loss_curves, new_figure, read_metrics, save_chart

CHART_NAME = "compare.png"


def default_chart_path(run_dirs: list[Path]) -> Path:
    """compare.png beside the first run directory: runs/compare.png for `nanopt eval runs/a runs/b`."""
    return Path(run_dirs[0]).parent / CHART_NAME


def check_chart_path(path: Path) -> None:
    """ConfigError unless `path` may receive the comparison chart: a .png that is missing or a chart nanopt drew,
    in a directory that exists."""
    hint = "give a new .png path with --chart, e.g. --chart runs/a-vs-b.png"
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--chart {path}: the chart is a PNG, its name must end in .png", hint)
    if not path.parent.is_dir():
        raise ConfigError(f"--chart {path}: directory {path.parent} does not exist", hint)
    if path.is_symlink() or (path.exists() and not (path.is_file() and _drawn_by_nanopt(path))):  # a FIFO: unread
        raise ConfigError(f"--chart {path}: exists and is not a chart nanopt drew; it is left as it is", hint)


def _drawn_by_nanopt(path: Path) -> bool:
    from PIL import Image  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == CHART_SOFTWARE
    except (OSError, ValueError):  # a directory, unreadable, not an image
        return False


def comparison_figure(run_dirs: list[Path], names: list[str] | None = None) -> Any:
    """The matplotlib Figure: per run, one colour, its train loss as a line, its validation loss as dots and a line,
    and its checkpoints' test loss as crosses, against tokens. Runs without a train record are left out (their name
    in the title says so)."""
    names = names or [str(run) for run in run_dirs]
    fig = new_figure(figsize=(9, 5), dpi=110)
    ax = fig.subplots()
    missing = []
    for index, (run, name) in enumerate(zip(run_dirs, names, strict=True)):
        train, val = loss_curves(read_metrics(run))
        if not train[0]:
            missing.append(name)
            continue
        color = f"C{index % 10}"
        ax.plot(*train, color=color, linewidth=1, alpha=0.8, label=f"{name} train")
        if val[0]:
            ax.plot(*val, "o-", color=color, markersize=4, label=f"{name} val")
        tested = loss_by_tokens(read_history(run))
        if tested[0]:
            ax.plot(*tested, "x", color=color, markersize=7, markeredgewidth=2, label=f"{name} test")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("train, validation and test loss" + (f" (no metrics: {', '.join(missing)})" if missing else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def write_comparison_chart(run_dirs: list[Path], path: Path, names: list[str] | None = None) -> Path:
    """Draw the comparison and save it at `path` (checked with check_chart_path first)."""
    check_chart_path(path)
    return save_chart(comparison_figure(run_dirs, names), path)
