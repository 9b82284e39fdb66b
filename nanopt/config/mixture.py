"""train.json's data mixture: several dataset directories read at chosen proportions, and a mixture per phase.

    "data": "data/web"                                        one dataset, as always
    "data": {"data/web": 0.7, "data/code": 0.3}               a mixture keyed by path (the path names the source)
    "data": {"web": {"path": "data/web", "weight": 0.7},      a mixture keyed by name
             "code": {"path": "data/code", "weight": 0.3}}
    "data_phases": [{"from": 0.9, "mixture": {"web": 0.2, "code": 0.8}}]

Weights are relative shares (0.7 and 0.3, or 7 and 3: each is divided by their sum). `data`'s weights hold from
step 0; each phase replaces them from its `from`: a fraction of the run's steps in (0, 1) (rounded to the nearest
step), a step number (an integer >= 1), or "decay", the first step of the WSD schedule's decay. A phase's mixture
names sources of `data`; the sources it leaves out are not read during the phase. Paths are relative to the run
directory, as a single `data` is (given with `--set`, to the current directory: nanopt.config.load). Every mistake
is one ConfigError naming train.json's key.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from nanopt.errors import ConfigError
from nanopt.parsing import show_value

DECAY = "decay"  # a phase's `from` that ties it to the WSD schedule's decay
MIXTURE_HINT = ("a mixture maps dataset directories to weights, e.g. {\"data/web\": 0.7, \"data/code\": 0.3}, or "
                "names to {\"path\": ..., \"weight\": ...}")


@dataclass(frozen=True)
class MixtureSource:
    name: str  # the key in train.json's `data`: a name, or the path itself
    path: str  # as written in train.json: relative to the run directory unless absolute
    weight: float  # relative share in `data`'s mixture (not normalized)


@dataclass(frozen=True)
class MixturePhase:
    start_step: int  # the first optimizer step (0-based) that reads this phase's mixture
    weights: tuple[float, ...]  # normalized to sum to 1, one per source in `data`'s order; 0: not read
    label: str  # where it was given: "data" or "data_phases[i]"


@dataclass(frozen=True)
class Mixture:
    sources: tuple[MixtureSource, ...]
    phases: tuple[MixturePhase, ...]  # the first starts at step 0; start steps strictly increase

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)

    def phase_at(self, step: int) -> MixturePhase:
        return [phase for phase in self.phases if phase.start_step <= step][-1]

    def weight_of(self, name: str) -> float:
        """The source's share in `data`'s mixture (phase 0), normalized."""
        return self.phases[0].weights[self.names.index(name)]


def wsd_decay_start(total_steps: int, warmup_steps: int, decay_fraction: float) -> int:
    """The first step of a WSD schedule's linear decay (nanopt.train.optim.schedule.lr_at uses the same step)."""
    warmup = min(warmup_steps, total_steps)
    return max(warmup, max(total_steps - 1, 1) - int(round(decay_fraction * total_steps)))


def parse_sources(data: dict[str, Any], source: str) -> tuple[MixtureSource, ...]:
    """`data` given as a JSON object: its sources in the order written, each weight checked."""
    if not data:
        raise ConfigError(f"{source}: key 'data': the mixture names no dataset", MIXTURE_HINT)
    sources = []
    for name, value in data.items():
        where = f"{source}: key 'data': source {show_value(name)}"
        if not name.strip():
            raise ConfigError(f"{where}: the name is empty", MIXTURE_HINT)
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"path", "weight"})
            if unknown or "path" not in value or "weight" not in value:
                problem = f"unknown key {show_value(unknown[0])}" if unknown else "needs both 'path' and 'weight'"
                raise ConfigError(f"{where}: {problem}", "write {\"path\": \"data/web\", \"weight\": 0.7}")
            path, weight = value["path"], value["weight"]
            if not isinstance(path, str):
                raise ConfigError(f"{where}: 'path' is {show_value(path)}, not a string",
                                  "give the dataset directory made by `nanopt tokenize`, e.g. \"data/web\"")
        else:
            path, weight = name, value
        sources.append(MixtureSource(name, path, _check_weight(weight, where)))
    _refuse_repeated_paths(sources, source)
    return tuple(sources)


def _check_weight(weight: Any, where: str) -> float:
    value = math.nan
    if isinstance(weight, (int, float)) and not isinstance(weight, bool):
        try:
            value = float(weight)
        except OverflowError:  # an integer of hundreds of digits
            pass
    if not math.isfinite(value):
        raise ConfigError(f"{where}: weight {show_value(weight)} is not a number",
                          "weights are relative shares, e.g. 0.7 and 0.3")
    if value <= 0:
        raise ConfigError(f"{where}: weight {show_value(weight)} is not positive",
                          "weights are relative shares above 0; leave a source out of a phase not to read it")
    return value


def _refuse_repeated_paths(sources: list[MixtureSource], source: str) -> None:
    seen: dict[str, str] = {}
    for item in sources:
        key = os.path.normpath(item.path)
        if key in seen:
            raise ConfigError(f"{source}: key 'data': sources {show_value(seen[key])} and {show_value(item.name)} "
                              f"are the same dataset {show_value(item.path)}",
                              "give each dataset once, with the sum of the weights")
        seen[key] = item.name


def resolve_mixture(data: Any, phases: Any, total_steps: int, decay_start: int | None,
                    source: str) -> Mixture | None:
    """The mixture train.json describes, its phases placed on steps; None for a single dataset (a string).
    decay_start: the WSD decay's first step, None when the schedule is not WSD."""
    if not isinstance(data, dict):
        if phases is not None:
            raise ConfigError(f"{source}: key 'data_phases': phases need a mixture in 'data'",
                              MIXTURE_HINT + "; or remove data_phases")
        return None
    sources = parse_sources(data, source)
    names = [item.name for item in sources]
    first = MixturePhase(0, _normalized([item.weight for item in sources]), "data")
    placed = [first]
    for index, phase in enumerate(phases or []):
        label = f"data_phases[{index}]"
        start = _phase_start(phase, label, total_steps, decay_start, source)
        if start <= placed[-1].start_step:
            raise ConfigError(f"{source}: key '{label}': it starts at step {start}, not after {placed[-1].label} "
                              f"(step {placed[-1].start_step})", "list the phases in the order they start")
        placed.append(MixturePhase(start, _phase_weights(phase["mixture"], names, label, source), label))
    return Mixture(sources, tuple(placed))


def _phase_start(phase: Any, label: str, total_steps: int, decay_start: int | None, source: str) -> int:
    where = f"{source}: key '{label}'"
    example = "e.g. {\"from\": 0.9, \"mixture\": {\"web\": 0.5, \"math\": 0.5}}"
    if not isinstance(phase, dict) or set(phase) != {"from", "mixture"}:
        raise ConfigError(f"{where}: a phase is an object with exactly 'from' and 'mixture'", example)
    start = phase["from"]
    if start == DECAY:
        if decay_start is None:
            raise ConfigError(f"{where}: 'from': \"decay\" needs \"lr_schedule\": \"wsd\"",
                              "use a fraction of the steps (0.9) or a step number instead")
        step = decay_start
    elif isinstance(start, float) and 0 < start < 1:
        step = int(round(start * total_steps))
    elif isinstance(start, int) and not isinstance(start, bool) and start >= 1:
        step = start
    elif isinstance(start, float) and start.is_integer() and start >= 1:  # 9000.0; not inf or nan
        step = int(start)
    else:
        raise ConfigError(f"{where}: 'from' {show_value(start)} is neither a fraction in (0, 1), a step >= 1, nor "
                          "\"decay\"", example)
    if not 0 < step < total_steps:
        placed = "" if step == start else f" (step {step})"
        hint = "a phase must start after step 0 and before the last step"
        if start == DECAY:  # the decay starts after warmup_steps and decay_fraction of the run from the end
            hint = ("the WSD decay starts where the warmup ends or decay_fraction of the steps before the end, "
                    "whichever is later: lower warmup_steps or raise decay_fraction")
        raise ConfigError(f"{where}: 'from' {show_value(start)}{placed} is outside the run's steps 1 to "
                          f"{total_steps - 1}", hint)
    return step


def _phase_weights(mixture: Any, names: list[str], label: str, source: str) -> tuple[float, ...]:
    where = f"{source}: key '{label}': 'mixture'"
    if not isinstance(mixture, dict) or not mixture:
        raise ConfigError(f"{where}: {show_value(mixture)} is not a non-empty object of source weights",
                          f"name sources of 'data' ({', '.join(names)}) with their weights")
    for name in mixture:
        if name not in names:
            raise ConfigError(f"{where}: unknown source {show_value(name)}",
                              f"the sources of 'data' are {', '.join(names)}")
    weights = [_check_weight(mixture[name], f"{where}: source {show_value(name)}") if name in mixture else 0.0
               for name in names]
    return _normalized(weights)


def _normalized(weights: list[float]) -> tuple[float, ...]:
    total = sum(weights)
    return tuple(weight / total for weight in weights)
