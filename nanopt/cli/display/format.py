"""Human formatting for rich output: numbers (124.4M, 2.48B tokens, 3.1e20 FLOPs, 12.3 GiB, 4h 05m) and tables that
fit the width they are shown in."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

# Past these, a number is shown in scientific notation (or as a bound), never as 20 or 40 digits: an estimate with
# an absurd option (a peak of 1e-300 TFLOP/s) or a hand-edited file must not print a wall of digits.
LARGE = 1e15
YEAR_S = 365.25 * 86_400
MAX_YEARS = 1000


def count(n: float | None) -> str:
    if n is None:
        return "-"
    if abs(n) >= LARGE:
        return f"{n:.2e}"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,.0f}" if n == 0 or abs(n) >= 1 else f"{n:.2g}"  # 0.0017 tokens/s, not 0


def exact(n: int | None) -> str:
    return "-" if n is None else f"{n:,}" if abs(n) < LARGE else f"{n:.2e}"


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    if abs(n) >= LARGE * (1 << 10):
        return f"{n:.2e} B"
    for unit, factor in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if 0 < seconds < 0.95:  # a small run's time in milliseconds: "0.0s" on every card compares nothing
        return f"{seconds * 1000:.2g} ms" if seconds < 0.0095 else f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds >= MAX_YEARS * YEAR_S:
        return f"> {MAX_YEARS} years"
    if seconds >= YEAR_S:
        return f"{seconds / YEAR_S:.1f} years"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def money(usd: float | None) -> str:
    """Dollars and cents; below ten cents at least four decimals and two significant digits, so a short run on a
    cheap machine is neither "$0.00" nor "$0.0000" ($0.000042: fractions of a cent still compare)."""
    if usd is None:
        return "-"
    if abs(usd) >= LARGE or 0 < abs(usd) < 1e-9:
        return f"${usd:.2e}"
    if 0 < abs(usd) < 0.1:
        return f"${usd:.{max(4, 1 - math.floor(math.log10(abs(usd))))}f}"
    return f"${usd:,.2f}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%" if abs(x) < LARGE else f"{100 * x:.2e}%"


def ratio(x: float) -> str:
    """A multiple such as 1.37 (x Chinchilla), in scientific notation when it is huge."""
    return f"{x:.2f}" if abs(x) < LARGE else f"{x:.2e}"


# ------------------------------------------------------------------------------------- tables that fit the width


def fits(out: Console, renderable: RenderableType) -> bool:
    """Whether `renderable` shows at its natural width, nothing wrapped or cut short, in `out`'s width (a terminal's
    own, COLUMNS, or nanopt.cli.terminal.PIPED_WIDTH when the output is a pipe or a file)."""
    # Measured as if there were room (a measurement is otherwise capped at the width it is asked about).
    unbounded = out.options.update_width(1 << 20)
    return Measurement.get(out, unbounded, renderable).maximum <= out.width


def print_records(out: Console, title: str, headers: list[str], records: list[list[str]], *, keys: int = 1,
                  left: frozenset[str] = frozenset()) -> None:
    """Rows of cells (rich markup) under `title`, every cell whole: one table when it fits the width; else the
    columns, in order, over as few tables as fit, each repeating the first `keys` columns so rows can be matched;
    else, in a width too narrow for any table, one block of `header  value` lines per row."""
    groups = _column_groups(out, headers, records, keys, left)
    if groups is None:
        _print_blocks(out, title, headers, records, keys)
        return
    for number, group in enumerate(groups):
        out.print(_table(title if number == 0 else None, headers, records, [*range(keys), *group], left))


def _column_groups(out: Console, headers: list[str], records: list[list[str]], keys: int,
                   left: frozenset[str]) -> list[list[int]] | None:
    """The columns after the keys packed greedily, in order, into tables that fit; None if one column alone does
    not fit beside the keys."""
    groups: list[list[int]] = [[]]
    for column in range(keys, len(headers)):
        if fits(out, _table(None, headers, records, [*range(keys), *groups[-1], column], left)):
            groups[-1].append(column)
        elif groups[-1] and fits(out, _table(None, headers, records, [*range(keys), column], left)):
            groups.append([column])
        else:
            return None
    return groups


def _table(title: str | None, headers: list[str], records: list[list[str]], columns: list[int],
           left: frozenset[str]) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(headers[column], justify="left" if headers[column] in left else "right", no_wrap=True)
    for record in records:
        table.add_row(*(record[column] for column in columns))
    return table


def _print_blocks(out: Console, title: str, headers: list[str], records: list[list[str]], keys: int) -> None:
    out.print(title)
    width = max(len(header) for header in headers[keys:])
    for record in records:
        out.print("  ".join(record[:keys + 1]))  # e.g. the rank and the run's name
        for header, cell in zip(headers[keys + 1:], record[keys + 1:], strict=True):
            out.print(f"    {header:<{width}}  {cell}")


# ------------------------------------------------------------------------------------------ time and money

PHASE_LABELS = {"setup": "setup (incl. compile)", "train": "training steps", "eval": "evaluation",
                "checkpoint": "checkpointing", "other": "other (logging, waiting)"}


def phase_table(t: dict[str, Any], title: str) -> Table:
    """Hours, share and cost of each phase (setup, train, eval, checkpoint, other), with the totals including and
    excluding evaluation, as users who pay by the hour add them up."""
    table = Table(title=title, title_justify="left")
    for name, justify in (("phase", "left"), ("time", "right"), ("share", "right"), ("cost", "right")):
        table.add_column(name, justify=justify)
    for name, label in PHASE_LABELS.items():
        phase = t["phases"][name]
        table.add_row(label, duration(phase["seconds"]), percent(phase["share"]), money(phase["cost_usd"]))
    table.add_row("total", duration(t["wall_seconds"]), "100%", money(t["cost_usd"]), style="bold")
    table.add_row("total without evaluation", duration(t["wall_seconds"] - t["phases"]["eval"]["seconds"]), "",
                  money(t["cost_excluding_eval_usd"]))
    if t.get("price_per_hour") is None and t.get("price_source"):
        table.caption = escape(f"no cost: {t['price_source']}")
    return table
