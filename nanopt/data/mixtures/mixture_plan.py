"""What a run on a data mixture will read from each source, before it runs: `estimate`, `preflight` and
`tokenize --run` show it.

For each source: its weight in `data`, the tokens the whole run reads from it (its samples over every phase, as the
training loader places them: nanopt.data.mixtures.interleave), the train tokens that one pass over them needs (samples x
seq_len + 1, as nanopt.data.budget counts one dataset), and, where the dataset is already there, its train split's
tokens and the epochs the run makes over it. A source is short when the run reads it more than once; too small
when more than data_epochs_warning times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanopt.data.meta import read_meta
from nanopt.data.mixtures.interleave import Interleave
from nanopt.errors import DataError

if TYPE_CHECKING:
    from nanopt.config import RunConfig


@dataclass(frozen=True)
class SourcePlan:
    name: str
    path: str
    weight: float  # in `data`, normalized
    run_tokens: int  # tokens the run's samples from it hold (seq_len each)
    tokens_needed: int  # train-split tokens for one pass over those samples
    split_tokens: int | None  # its train split's tokens; None when the dataset is not there (yet)
    epochs: float | None  # passes over its train split; None without the dataset
    short: bool  # the run reads it more than once
    too_small: bool  # ... more than data_epochs_warning times


def plan_mixture(run: RunConfig) -> list[SourcePlan] | None:
    """The plan of each source of the run's mixture (None for a single dataset). Each dataset's meta.json is read
    and checked if it exists; one that does not is planned without its size."""
    mixture = run.mixture
    if mixture is None:
        return None
    per_step = run.train.global_batch_tokens // run.seq_len  # samples of every rank in one optimizer step
    interleave = Interleave([phase.start_step * per_step for phase in mixture.phases],
                            [phase.weights for phase in mixture.phases])
    samples = interleave.given_before(run.total_steps * per_step)
    plans = []
    for index, (item, path) in enumerate(zip(mixture.sources, run.data_dirs, strict=True)):
        split = _train_tokens(path)
        windows = None if split is None else max(0, (split - 1) // run.seq_len)
        epochs = None if not windows else int(samples[index]) / windows
        plans.append(SourcePlan(
            name=item.name, path=str(path), weight=mixture.weight_of(item.name),
            run_tokens=int(samples[index]) * run.seq_len, tokens_needed=int(samples[index]) * run.seq_len + 1,
            split_tokens=split, epochs=epochs, short=epochs is not None and epochs > 1,
            too_small=windows == 0 or (epochs is not None and epochs > run.train.data_epochs_warning)))
    return plans


def plan_records(run: RunConfig) -> list[dict[str, Any]] | None:
    """plan_mixture as JSON-ready records (estimate --json, preflight.json)."""
    plans = plan_mixture(run)
    return None if plans is None else [asdict(plan) for plan in plans]


def _train_tokens(path: Path) -> int | None:
    if not (path / "meta.json").is_file():
        return None
    try:
        return int(read_meta(path)["splits"]["train"]["tokens"])
    except (DataError, KeyError):
        return None
