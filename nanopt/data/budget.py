"""Token counts as people write them: `3.3B`, `20e9`, `500M`, `1_000_000`, or `chinchilla` for a run's model."""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal, DecimalException
from pathlib import Path

from nanopt.config import RunConfig, load_run
from nanopt.errors import ConfigError
from nanopt.parsing import INT64_MAX

SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_NUMBER = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)
_HINT = "write e.g. 500M, 2.5B, 20e9, 1000000, or chinchilla (with --run runs/NAME)"


def parse_token_count(text: str, option: str = "--max-tokens") -> int:
    """An exact positive integer: decimal arithmetic, so `3.3B` is 3300000000, not 3299999999."""
    match = _NUMBER.match(text)
    if not match:
        raise ConfigError(f"{option} {_shown(text)} is not a token count", _HINT)
    digits, suffix = match.group(1).replace("_", "").replace(",", ""), match.group(2).upper()
    try:
        value = Decimal(digits) * SUFFIXES[suffix]
        whole = value == value.to_integral_value()
    except DecimalException:  # an exponent past what decimal arithmetic holds (1e999999999)
        raise ConfigError(f"{option} {_shown(text)} is not a token count", _HINT) from None
    if not whole:
        raise ConfigError(f"{option} {_shown(text)} is not a whole number of tokens", _HINT)
    if value <= 0:
        raise ConfigError(f"{option} {_shown(text)} must be positive", _HINT)
    # Token counts are int64 in numpy and torch; a count past that is a typo (1e30), and int() of 1e5000 would be
    # a number too long to print.
    if value > INT64_MAX:
        raise ConfigError(f"{option} {_shown(text)} is more than 2**63 - 1 tokens", _HINT)
    return int(value)


def _shown(text: str, limit: int = 40) -> str:
    """The text as typed, shortened if long (9 repeated 5,000 times), for a one-line message."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def chinchilla_tokens(run_dir: Path | str) -> int:
    """20 tokens per parameter of the run's model (Hoffmann et al. 2022), parameters as `nanopt estimate` counts."""
    return _chinchilla_budget(load_run(run_dir))


def _chinchilla_budget(run: RunConfig) -> int:
    from nanopt.model import flops

    return flops.chinchilla_tokens(flops.count_params(run.model).total)


def tokens_to_train(run: RunConfig) -> int:
    """The train-split tokens `nanopt train` reads for `run`, each once: its total_steps whole global batches of
    windows of seq_len + 1 tokens at stride seq_len (nanopt.data.loader), so RunConfig.total_tokens plus the last
    window's last target."""
    return run.total_tokens + 1


def chinchilla_train_tokens(run_dir: Path | str) -> int:
    """`--max-tokens chinchilla`: the tokens that training the run for its Chinchilla budget needs. That budget as
    train_tokens is rounded up to whole global batches, as `nanopt train` rounds it, plus the one extra token, so
    a run whose train.json says train_tokens = 20 x parameters trains to its end on exactly this dataset."""
    run = load_run(run_dir)
    at_chinchilla = dataclasses.replace(run.train, train_tokens=_chinchilla_budget(run), max_steps=None)
    return tokens_to_train(dataclasses.replace(run, train=at_chinchilla))


def resolve_max_tokens(text: str | None, run_dir: Path | str | None = None) -> int | None:
    """The --max-tokens option: None (no budget), a count, or `chinchilla` (needs --run; a run given without it
    still sets the held-out splits' defaults, nanopt.data.settings)."""
    if text is None:
        return None
    if text.strip().lower() == "chinchilla":
        if run_dir is None:
            raise ConfigError("--max-tokens chinchilla needs --run, the run whose model sets the budget",
                              "add --run runs/NAME")
        return chinchilla_train_tokens(run_dir)
    return parse_token_count(text)
