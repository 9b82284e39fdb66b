"""Human formatting of numbers for rich tables: 124.4M, 2.48B tokens, 3.1e20 FLOPs, 12.3 GiB, 4h 05m."""

from __future__ import annotations


def count(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,.0f}"


def exact(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {secs:02d}s"


def money(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:,.2f}"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
