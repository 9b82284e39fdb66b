"""The summary of a `nanopt tokenize` run: per-split statistics, throughput, and what the person must know (an empty
or too small held-out split, a --max-tokens the corpus could not fill, undecodable bytes, leftovers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.data.output import leftover_staging_dirs
from nanopt.data.tokenize.documents import HELD_OUT
from nanopt.data.tokenize.settings import RunEval


def summarize(out: Path, meta: dict[str, Any], seconds: float, encode_seconds: float, extra: dict[str, Any],
              evaluation: RunEval | None) -> dict[str, Any]:
    """What `nanopt tokenize` prints and returns: each split's statistics (shard count, not the shard list), the
    throughput of encoding (`encode_seconds` of the `seconds` in all; `extra` from the pipeline run), and what the
    person must know: warnings, and notes on held-out splits short of their targets."""
    splits = {name: {k: v for k, v in info.items() if k != "shards"} | {"shards": len(info["shards"])}
              for name, info in meta["splits"].items()}
    tokens = sum(s["tokens"] for s in splits.values())
    documents = sum(s["documents"] for s in splits.values())
    settings = meta["settings"]
    budget = _budget(settings, splits["train"]["tokens"])
    warnings = [f"split '{name}' is empty: raise --{name}-fraction or give more documents (text files: "
                f"--sample-by paragraph)" for name in HELD_OUT if not splits[name]["documents"]
                and settings[f"{name}_fraction"] > 0]
    warnings += _one_document_warnings(splits) + _budget_warnings(budget) + _eval_window_warnings(splits, evaluation)
    warnings += [f"leftover {p} from an interrupted run: delete it" for p in leftover_staging_dirs(out)]
    undecodable = meta["source"].get("undecodable_bytes_by_file", {})
    if undecodable:
        files = f"{len(undecodable):,} file" + ("s" if len(undecodable) > 1 else "")
        warnings.append(f"{sum(undecodable.values()):,} bytes that are not UTF-8 in {files} were replaced with U+FFFD "
                        "(per file: source.undecodable_bytes_by_file in meta.json)")
    rate_seconds = max(encode_seconds, 1e-9)
    return {"out": str(out), "tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"],
            "dtype": meta["dtype"], "splits": splits, "documents": documents, "tokens": tokens,
            "seconds": round(seconds, 3), "tokenize_seconds": round(encode_seconds, 3),
            "tokens_per_second": round(tokens / rate_seconds, 1),
            "documents_per_second": round(documents / rate_seconds, 1), **extra,
            "undecodable_bytes": sum(undecodable.values()), "budget": budget, "warnings": warnings,
            "notes": _held_out_notes(splits, settings, extra)}


def _one_document_warnings(splits: dict[str, dict[str, Any]]) -> list[str]:
    """A held-out split that is one document, or mostly one: every loss measured on it measures that text (a man
    page of 145,911 tokens was a whole val split), not the corpus."""
    warnings = []
    for name in HELD_OUT:
        info = splits[name]
        documents, tokens, longest = info["documents"], info["tokens"], info["longest_document_tokens"]
        if documents == 1:
            said = f"{name} is one document of {longest:,} tokens: every evaluation on {name} measures that one text"
        elif documents and 2 * (longest + 1) > tokens:  # the document and its end-of-text token
            share = (longest + 1) / tokens
            said = (f"{name} is mostly one document ({longest:,} of its {tokens:,} tokens, {share:.0%}, in "
                    f"{documents:,} documents): evaluation on {name} mostly measures that one text")
        else:
            continue
        warnings.append(f"{said}; hold out more documents: raise --{name}-fraction (e.g. 0.2) and --{name}-tokens, "
                        "or cut long documents (text files: --sample-by paragraph)")
    return warnings


def _budget(settings: dict[str, Any], train_tokens: int) -> dict[str, Any] | None:
    """What --max-tokens asked for and what train got: a corpus smaller than the budget is not an error (training
    repeats the data), but the summary says so."""
    asked = settings["max_tokens"]
    if asked is None:
        return None
    return {"max_tokens": asked, "as_given": settings["max_tokens_as_given"], "train_tokens": train_tokens,
            "reached": train_tokens >= asked, "share": round(train_tokens / asked, 6),
            "repeats": round(asked / train_tokens, 3) if train_tokens else None}


def _budget_warnings(budget: dict[str, Any] | None) -> list[str]:
    if budget is None or budget["reached"]:
        return []
    asked, got = budget["max_tokens"], budget["train_tokens"]
    repeats = f"a run to that budget repeats the data {asked / got:.1f} times" if got else "nothing is left to train on"
    return [f"train has {got:,} tokens, {got / asked:.1%} of the {asked:,} asked for (--max-tokens "
            f"{budget['as_given'] or asked}); {repeats}"]


def _eval_window_warnings(splits: dict[str, dict[str, Any]], evaluation: RunEval | None) -> list[str]:
    """With --run: a held-out split (not empty: that has its own warning) shorter than one of the run's evaluation
    windows, so that in-loop evaluation (val) or `nanopt eval` (test) has nothing to score."""
    if evaluation is None:
        return []
    return [f"split '{name}' has {tokens:,} tokens, fewer than one evaluation window of {evaluation.run} "
            f"({evaluation.describe_window()}): raise --{name}-tokens or --{name}-fraction, give more documents, or "
            "lower seq_len" for name in HELD_OUT
            if 0 < (tokens := splits[name]["tokens"]) < evaluation.window_tokens]


def _held_out_notes(splits: dict[str, dict[str, Any]], settings: dict[str, Any],
                    extra: dict[str, Any]) -> list[str]:
    """A held-out split short of its target: the source ran out, and evaluation scores all of that split. What it
    took is said as it is: the hash's share of the documents read, which past train's --max-tokens (reading goes
    on to fill val and test) is a larger share of the dataset's documents."""
    notes = []
    read = extra["documents_read"] - extra["empty_documents_skipped"]
    total = sum(info["documents"] for info in splits.values())
    for name in HELD_OUT:
        info, target = splits[name], settings[f"{name}_tokens"]
        tokens, documents = info["tokens"], info["documents"]
        if not tokens or target is None or tokens >= target:
            continue
        held = f"{documents:,} document" + ("s" if documents > 1 else "")
        note = (f"{name} has {tokens:,} tokens in {held}, short of its {target:,}-token target: the source ran "
                f"out. The hash held out {documents / read:.1%} of the {read:,} documents read for {name} "
                f"(--{name}-fraction {settings[f'{name}_fraction']:g})")
        if extra["stopped_at_budget"]:
            note += (f"; train stopped at --max-tokens, so {name} is {documents / total:.0%} of this dataset's "
                     f"{total:,} documents")
        notes.append(note + "; evaluation scores all of it")
    return notes
