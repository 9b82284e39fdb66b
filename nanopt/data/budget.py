"""Token counts as people write them: `3.3B`, `20e9`, `500M`, `1_000_000`, or `chinchilla` for a run's model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nanopt.config import RunConfig, load_run
from nanopt.errors import ConfigError
from nanopt.parsing import TOKEN_COUNT_HINT, parse_token_count  # re-exported: tokenize and eval read counts here

_MAX_TOKENS_HINT = f"{TOKEN_COUNT_HINT}, or chinchilla (with --run runs/NAME)"


def chinchilla_tokens(run_dir: Path | str) -> int:
    """20 tokens per parameter of the run's model (Hoffmann et al. 2022), parameters as `nanopt estimate` counts."""
    return _chinchilla_budget(load_run(run_dir))


def _chinchilla_budget(run: RunConfig) -> int:
    from nanopt.model import flops

    return flops.chinchilla_tokens(flops.count_params(run.model).total)


def tokens_to_train(run: RunConfig) -> int:
    """The train-split tokens `run` reads in one pass, each once: its total_steps whole global batches of windows of
    seq_len + 1 tokens at stride seq_len (nanopt.data.loaders.loader), so RunConfig.total_tokens plus the last window's
    last target. A smaller split is read more than once (several epochs)."""
    return run.total_tokens + 1


def chinchilla_train_tokens(run_dir: Path | str, out: Path | str | None = None) -> int:
    """`--max-tokens chinchilla`: the tokens that training the run for its Chinchilla budget needs. That budget as
    train_tokens is rounded up to whole global batches, as `nanopt train` rounds it, plus the one extra token, so
    a run whose train.json says train_tokens = 20 x parameters trains to its end on exactly this dataset. For a
    mixture whose source is `out` (the dataset being made): that source's share of it, over every phase."""
    run = load_run(run_dir)
    at_chinchilla = dataclasses.replace(run.train, train_tokens=_chinchilla_budget(run), max_steps=None)
    run = dataclasses.replace(run, train=at_chinchilla)
    if out is not None and run.mixture is not None:
        from nanopt.data.mixtures.mixture_plan import plan_mixture

        for plan in plan_mixture(run) or []:
            if Path(plan.path).resolve() == Path(out).resolve():
                return plan.tokens_needed
    return tokens_to_train(run)


def resolve_max_tokens(text: str | None, run_dir: Path | str | None = None,
                       out: Path | str | None = None) -> int | None:
    """The --max-tokens option: None (no budget), a count, or `chinchilla` (needs --run; a run given without it
    still sets the held-out splits' defaults, nanopt.data.tokenize.settings). `out`: the dataset being made, which may
    be one source of the run's mixture."""
    if text is None:
        return None
    if text.strip().lower() == "chinchilla":
        if run_dir is None:
            raise ConfigError("--max-tokens chinchilla needs --run, the run whose model sets the budget",
                              "add --run runs/NAME")
        return chinchilla_train_tokens(run_dir, out)
    return parse_token_count(text, "--max-tokens", _MAX_TOKENS_HINT)
