"""A run's prediction on screen: recorded by `nanopt train` before the first step (the live display's start, on rank
0, once the run is locked and set up), and shown against what was measured at the end of each session and by
`nanopt eval RUN` (nanopt.train.observe.prediction.compared)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table

from nanopt.cli.display import format as fmt
from nanopt.cli.display.train import Display
from nanopt.errors import NanoptError


class PredictingDisplay(Display):
    """The training display, which first writes RUN/prediction.json when the session starts at step 0."""

    def __init__(self, run: Any, world_size: int, **display: Any) -> None:
        super().__init__(**display)
        self.run, self.world_size = run, world_size

    def start(self, total_steps: int, step: int) -> None:
        if step == 0:
            self.note(_recorded(self.run, self.world_size))
        super().start(total_steps, step)


def _recorded(run: Any, world_size: int) -> str:
    """Predict and record; what to say of it. A prediction that cannot be made (a hand-made config the estimate
    refuses, a full disk) is said, and training goes on: the prediction is a measurement's yardstick, not a step."""
    from nanopt.plan.prediction import record_prediction

    try:
        made = record_prediction(run, world_size)
    except (NanoptError, OSError) as exc:
        return f"no prediction recorded: {exc}"
    if made is None:
        return "no prediction recorded: this GPU is not in nanopt's table, so there is no peak to predict from"
    cost = "" if made["cost_usd"] is None else f", {fmt.money(made['cost_usd'])}"
    note = made["throughput"]["note"]
    return (f"predicted before the first step ({made['throughput']['source']} throughput): "
            f"{made['tokens_per_s']:,.0f} tokens/s, {made['step_s']:.3g} s a step, "
            f"{fmt.size(made['peak_memory_bytes'])} peak per device, the whole run {fmt.duration(made['total_s'])}"
            f"{cost} (in {run.run_dir / 'prediction.json'})" + (f"; {note}" if note else ""))


def prediction_table(c: dict[str, Any]) -> Table:
    """Predicted against measured, with measured / predicted; a total of a run not yet complete is so far."""
    status = "complete" if c["complete"] else f"at step {c['steps']:,} of {c['total_steps'] or '?'}"
    table = Table(title=escape(f"predicted before the first step ({c['made_by']}, {c['throughput_source']} "
                               f"throughput) against measured ({status})"),
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for header in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(header, justify="left" if not header else "right")
    for row in c["rows"]:
        measured = _value(row["measured"], row["unit"]) + (" so far" if row["so_far"] and row["measured"] else "")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        table.add_row(row["label"], _value(row["predicted"], row["unit"]), measured, ratio)
    return table


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "tokens/s":
        return f"{value:,.0f}"
    if unit == "bytes":
        return fmt.size(value)
    if unit == "usd":
        return fmt.money(value)
    return f"{value:.3g} s" if value < 1 else fmt.duration(value)
