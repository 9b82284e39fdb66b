"""The range checks every config key shares: each names the file and the key of a mistake, with a hint."""

from __future__ import annotations

import math
from typing import Any

from nanopt.errors import ConfigError
from nanopt.parsing import show_value


def divisors(n: int, low: int, high: int) -> list[int]:
    return [d for d in range(low, high + 1) if n % d == 0][:8]


def check_positive(cfg: Any, source: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{source}: key '{name}': must be positive, got {value}", "use a number > 0")


def check_non_negative(cfg: Any, source: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 0:
            raise ConfigError(f"{source}: key '{name}': must not be negative, got {value}", "use 0 or more")


def check_range(cfg: Any, source: str, name: str, low: float, high: float, hint: str) -> None:
    value = getattr(cfg, name)
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"{source}: key '{name}': {show_value(value)} is outside [{low:g}, {high:g}]", hint)
