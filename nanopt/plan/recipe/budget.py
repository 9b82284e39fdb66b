"""`nanopt plan --budget`: what a person can spend, in dollars, wall-clock time or training FLOPs.

    500USD, $500, 500usd      money: the run's hours are USD / (GPUs x price per GPU-hour)
    24h, 90min, 45s, 1.5d     wall-clock time of the whole run (setup, steps, evaluations, checkpoints)
    1e19, 1e19FLOPs           the training steps' model FLOPs (nanopt's count: nanopt.model.flops.flops_per_token)

A bare number below MIN_FLOPS has lost its unit (`--budget 500` is not 500 FLOPs): it is refused with the spellings
that would mean it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from nanopt.errors import ConfigError
from nanopt.parsing import show_value
from nanopt.plan.estimate.options import MAX_BUDGET_FLOPS

MIN_FLOPS = 1e6  # as `estimate --flops`: below, a number is a budget whose unit was left out
MAX_SECONDS = 100 * 365.25 * 86_400  # a century of training: past it a budget is a typo
MAX_USD = 1e12
SECONDS = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hr": 3600, "hours": 3600, "hour": 3600, "d": 86_400,
           "days": 86_400, "day": 86_400}
_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)"
HINT = "write it as money (500USD), wall-clock time (24h, 90min) or training FLOPs (1e19)"


@dataclass(frozen=True)
class Budget:
    kind: str  # "usd", "seconds" or "flops"
    amount: float
    text: str  # as typed, for messages

    def describe(self) -> str:
        if self.kind == "usd":
            return f"${self.amount:,.2f}"
        if self.kind == "seconds":
            return _duration(self.amount)
        return f"{self.amount:.3g} FLOPs"

    def scaled(self, factor: float, up: bool = True) -> str:
        """This budget times `factor`, written as --budget takes it and rounded up (a budget to raise to) or down (one
        to lower to): what a refusal asks for instead."""
        value = self.amount * factor
        if self.kind == "usd":
            return f"{_round(value, 0.01, up):g}USD"
        if self.kind == "seconds":
            if value < 120:
                return f"{_round(value, 1, up):g}s"
            return f"{_round(value / 60, 1, up):g}min" if value < 3 * 3600 else f"{_round(value / 3600, 0.1, up):g}h"
        exponent = math.floor(math.log10(value))
        return f"{_round(value / 10.0 ** exponent, 0.1, up):g}e{exponent}"  # two significant digits: 1.3e11


def _round(value: float, step: float, up: bool) -> float:
    units = math.ceil(value / step - 1e-9) if up else max(1, math.floor(value / step + 1e-9))
    return round(units * step, 10)


def parse_budget(text: str) -> Budget:
    raw = text.strip().lower().replace(",", "").replace("_", "").replace(" ", "")
    money = re.fullmatch(rf"\$?{_NUMBER}(usd|\$)?", raw)
    if money and (raw.startswith("$") or money.group(2)):
        return _checked(Budget("usd", float(money.group(1)), text), MAX_USD)
    timed = re.fullmatch(rf"{_NUMBER}([a-z]+)", raw)
    if timed and timed.group(2) in SECONDS:
        return _checked(Budget("seconds", float(timed.group(1)) * SECONDS[timed.group(2)], text), MAX_SECONDS)
    flops = re.fullmatch(rf"{_NUMBER}(flops?)?", raw)
    if flops:
        value = float(flops.group(1))
        if value < MIN_FLOPS and not flops.group(2):
            raise ConfigError(f"--budget {show_value(text)}: a number without a unit",
                              f"{HINT}; e.g. {text.strip()}USD or {text.strip()}h")
        return _checked(Budget("flops", value, text), MAX_BUDGET_FLOPS, smallest=MIN_FLOPS)
    raise ConfigError(f"--budget {show_value(text)}: cannot read it", HINT)


def _checked(budget: Budget, high: float, smallest: float | None = None) -> Budget:
    """The budget, unless it is nothing (or less than `smallest`), infinite, or past `high`."""
    low_ok = budget.amount >= smallest if smallest is not None else budget.amount > 0
    if not (math.isfinite(budget.amount) and low_ok and budget.amount <= high):
        raise ConfigError(f"--budget {show_value(budget.text)}: {budget.describe()} is outside what a run can be",
                          f"{HINT}, more than nothing and at most {high:.3g}")
    return budget


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"
