"""health.png (nanopt.train.health.replay.health_figure): every panel's legend stands beside the panel, never over a
point of its curves, whatever the curves cover."""

from __future__ import annotations

import math
from pathlib import Path

from nanopt.train.health.replay import HealthCurves, health_figure


def _records(steps: int = 300) -> list[dict]:
    """Curves that fill each panel from edge to edge and top to bottom: wherever a legend stood inside a panel, a
    curve would pass under it."""
    found = []
    for step in range(10, steps + 1, 10):
        wave = 0.5 + 0.5 * math.sin(step / 17)
        blocks = {f"layers.{i}": 0.04 * (1 + i) ** (2 * wave) for i in range(4)}
        found.append({"kind": "train", "step": step, "loss": 6 - 3 * step / steps + wave, "grad_norm": 0.05 + wave,
                      "grad_norm_blocks": {"embed_tokens": 0.01 + wave, **blocks},
                      "update_ratio": {"decay": 1e-4 * 10 ** (2 * wave), "no_decay": 1e-5 * 10 ** (3 * wave)},
                      "clipped_fraction": wave})
    return found


def test_no_legend_covers_a_point_of_its_panel(tmp_path: Path):
    curves = HealthCurves()
    for record in _records():
        curves.add(record)
    figure = health_figure(curves, [{"name": "plateau", "step": 150}], tmp_path / "run")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    legends = 0
    for ax in figure.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        legends += 1
        box = legend.get_window_extent(renderer)
        for line in ax.get_lines():
            for x, y in ax.transData.transform(line.get_xydata()):
                assert not box.contains(x, y), (ax.get_ylabel(), line.get_label())
    assert legends == 2  # gradient norms by block, update ratios by group
