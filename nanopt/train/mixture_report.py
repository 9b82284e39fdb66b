"""What a run on a data mixture says about its sources: how often each will be read (at start-up), the tokens and
epochs each gave so far (every metrics.jsonl train record, the live line, the end-of-run summary).

A single-dataset run has none of this: every function here returns nothing for it, and the loop's own data-repeats
warning speaks for its one split.
"""

from __future__ import annotations

from typing import Any

from nanopt.train.metrics import iter_metrics
from nanopt.train.session import Session


def _mixture_loader(s: Session) -> Any:
    loader = getattr(s.loader, "inner", s.loader)  # preflight and profile wrap the loader to time it
    return loader if hasattr(loader, "accounting") else None


def source_record(s: Session, step: int) -> dict[str, Any]:
    """{"sources": {name: {"tokens", "epochs"}}} after `step` steps: the same on every rank and world size."""
    loader = _mixture_loader(s)
    return {} if loader is None else {"sources": loader.accounting(step)}


def source_summary(s: Session, step: int) -> dict[str, Any]:
    """source_record with each source's weight in `data` and its latest validation loss (None before any)."""
    record = source_record(s, step)
    mixture = s.run.mixture
    for name, figures in record.get("sources", {}).items():
        figures["weight"] = mixture.weight_of(name)
        figures["val_loss"] = s.source_val_losses.get(name)
    return record


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
