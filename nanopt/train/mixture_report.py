"""What a run on a data mixture says about its sources: how often each will be read (at start-up), the tokens and
epochs each gave so far (every metrics.jsonl train record, the live line, the end-of-run summary), and each data
phase it reaches (a line and a `data_phase` event at the first step that reads it; the summary lists every phase).

A single-dataset run has none of this: every function here returns nothing for it, and warn_if_data_repeats
speaks for its one split.
"""

from __future__ import annotations

import bisect
from typing import Any

from nanopt.train.observe.metrics import iter_metrics
from nanopt.train.session import Session


def _mixture_loader(s: Session) -> Any:
    loader = getattr(s.loader, "inner", s.loader)  # preflight and profile wrap the loader to time it
    return loader if hasattr(loader, "accounting") else None


def source_record(s: Session, step: int) -> dict[str, Any]:
    """{"sources": {name: {"tokens", "epochs"}}} after `step` steps: the same on every rank and world size."""
    loader = _mixture_loader(s)
    return {} if loader is None else {"sources": loader.accounting(step)}


def source_summary(s: Session, step: int) -> dict[str, Any]:
    """source_record with each source's weight in `data` and its latest validation loss (None before any), and,
    for a mixture with phases, `data_phases`: each phase's steps and weights."""
    record = source_record(s, step)
    mixture = s.run.mixture
    for name, figures in record.get("sources", {}).items():
        figures["weight"] = mixture.weight_of(name)
        figures["val_loss"] = s.source_val_losses.get(name)
    if record and len(mixture.phases) > 1:
        record["data_phases"] = phase_plan(mixture, s.total_steps)
    return record


def phase_plan(mixture: Any, total_steps: int) -> list[dict[str, Any]]:
    """Each phase of a mixture: its number, where train.json gives it, its steps (1-based, first to last) and its
    weight per source (0: not read in it)."""
    ends = [phase.start_step for phase in mixture.phases[1:]] + [total_steps]
    return [{"phase": number, "label": phase.label, "first_step": phase.start_step + 1, "last_step": end,
             "weights": dict(zip(mixture.names, phase.weights, strict=True))}
            for number, (phase, end) in enumerate(zip(mixture.phases, ends, strict=True), start=1)]


class PhaseWatch:
    """Says when training reaches a data phase: after the first step that read it, a line and a `data_phase` event
    at that step (rank 0 writes and prints; every rank keeps the same count, no collective depends on it).

    What it has said follows metrics.jsonl: a phase's event is written after that phase's first step, so a
    checkpoint from before that step resumes without it (and says it again at the same step) and one from after
    keeps it (and the phase in effect, read from the loader's position, is the event's). A rollback drops the
    records after its checkpoint: the announcements after it go too, and the phase the rolled-back weights last
    read is the one compared with. The loader's position, not the step count, decides: a recovery that skipped
    data moves it ahead of the steps, and a phase starts at its samples."""

    def __init__(self, s: Session) -> None:
        phases = s.run.mixture.phases if _mixture_loader(s) is not None else ()
        self.starts = [phase.start_step for phase in phases] if len(phases) > 1 else []
        self.offset = s.loader.step - s.state.step  # data steps ahead of the steps: earlier recoveries' skips
        # (step, phase index): the phase of the data the weights of that step last read, as the records say
        self.said = [(s.state.step, self._phase(s.loader.step - 1))] if self.starts else []

    def _phase(self, data_step: int) -> int:
        return bisect.bisect_right(self.starts, max(0, data_step)) - 1

    def after_step(self, s: Session) -> None:
        """After a step that was kept (not rolled back): say the phase its data came from, if it is a new one."""
        if not self.starts:
            return
        step = s.state.step
        while self.said and self.said[-1][0] >= step:  # a rollback: the steps from here on are trained again
            self.said.pop()
        if not self.said:  # rolled back past this session's start: the phase of the data before its checkpoint
            self.said.append((step - 1, self._phase(step - 2 + self.offset)))
        phase = self._phase(s.loader.step - 1)
        if phase != self.said[-1][1]:
            self.said.append((step, phase))
            _announce_phase(s, phase)


def _announce_phase(s: Session, index: int) -> None:
    phases, names = s.run.mixture.phases, s.run.mixture.names
    phase = phases[index]
    weights = dict(zip(names, phase.weights, strict=True))
    s.metrics.write("event", step=s.state.step, event="data_phase", phase=index + 1, phases=len(phases),
                    label=phase.label, weights=weights, data_step=s.loader.step - 1)
    read = ", ".join(f"{name} {weight:.2f}" for name, weight in weights.items() if weight > 0)
    s.observer.note(f"step {s.state.step}: data phase {index + 1} of {len(phases)} from here on ({phase.label}): "
                    f"{read}")


def evaluate_sources(s: Session, batches: Any) -> tuple[Any, dict[str, Any]]:
    """The validation loss (a mixture's: over all sources, their token-weighted mean) and the fields each source
    adds to the eval record; the session keeps each source's latest loss for the end-of-run summary."""
    from nanopt.train.validation import evaluate_by_source

    result, by_source = evaluate_by_source(s.prepared.model, s.rt, batches)
    s.source_val_losses = {name: r["val_loss"] for name, r in by_source.get("sources", {}).items()}
    return result, by_source


def announce_sources(s: Session) -> bool:
    """For a mixture: say, before the first step, the tokens and epochs each source gives over the whole run, and
    warn of those read more than data_epochs_warning times (recorded once per run and budget in metrics.jsonl, as
    the `source_repeats` event). False for a single dataset, which the loop's data-repeats warning covers."""
    loader = _mixture_loader(s)
    if loader is None:
        return False
    planned = loader.accounting(s.total_steps)
    limit = s.run.train.data_epochs_warning
    for name, figures in planned.items():
        s.observer.note(f"source {name}: {figures['tokens']:,} tokens over the run, {figures['epochs']:.2f} epochs "
                        f"of its train split")
    over = {name: figures["epochs"] for name, figures in planned.items() if figures["epochs"] > limit}
    if not over or not s.rt.is_main or s.state.step >= s.total_steps:
        return True
    listing = ", ".join(f"{name} {epochs:.2f}" for name, epochs in over.items())
    s.observer.note(f"warning: sources read more than data_epochs_warning = {limit:g} times: {listing} epochs "
                    "(lower their weight, tokenize more of them, or raise data_epochs_warning)")
    if not any(r.get("event") == "source_repeats" and r.get("run_tokens") == s.run.total_tokens
               for r in iter_metrics(s.run.run_dir)):
        s.metrics.write("event", step=s.state.step, event="source_repeats", run_tokens=s.run.total_tokens,
                        limit=limit, epochs=over)
    return True


def warn_if_data_repeats(s: Session) -> None:
    """Tell the person, once per run and before its first step, that it reads its train split more than once, and
    record it in metrics.jsonl: the event (at the step the run starts from) survives every resume, so a run
    resumed again and again is not told again, and whoever reads the metrics later sees it. A budget raised on
    resume (--allow-changed) reads another number of tokens, so it is said again. Rank 0 only: it alone reads and
    writes metrics.jsonl, and no collective depends on this."""
    epochs = s.loader.epochs_at(s.total_steps)
    if not s.rt.is_main or epochs <= 1 or s.state.step >= s.total_steps:  # a complete run writes nothing
        return
    record = {"split_tokens": s.dataset.split_tokens("train"), "split_sequences": s.loader.num_windows,
              "seq_len": s.run.seq_len, "run_tokens": s.run.total_tokens, "epochs": epochs}
    if any(r.get("event") == "data_repeats" and r.get("run_tokens") == record["run_tokens"]
           for r in iter_metrics(s.run.run_dir)):
        return
    s.metrics.write("event", step=s.state.step, event="data_repeats", **record)
    s.observer.data_repeats(record)
