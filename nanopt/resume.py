"""Whether a checkpoint may be resumed with today's settings.

Three kinds of setting:
- free: logging, eval and checkpoint cadence, compile, activation checkpointing; they do not change the maths.
- allowed with --allow-changed: the learning-rate schedule, the budget, clipping, weight decay, micro-batch
  size (the global batch stays) and the world size (the loader's position is global, so the same samples
  follow on any number of ranks).
- never: the model, the dataset, seq_len, the global batch and the seed; the run would silently be another.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ResumeError

FREE = {"eval_interval", "eval_tokens", "checkpoint_interval", "keep_checkpoints", "log_interval", "compile",
        "activation_checkpointing", "max_nonfinite_steps", "spike_threshold"}
NEVER = {"data", "seq_len", "global_batch_tokens", "seed"}


def data_fingerprint(dataset: Any) -> str:
    """A hash of the dataset's shard checksums: the same path re-tokenized differently is another dataset."""
    splits = dataset.meta.get("splits", dataset.meta)
    return hashlib.sha256(json.dumps(splits, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    diffs = []
    for section in ("model", "train"):
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                diffs.append((f"{section}.{key}", old.get(key), new.get(key)))
    return diffs


def check_resumable(meta: dict[str, Any], run: RunConfig, world_size: int, fingerprint: str,
                    allow_changed: bool) -> None:
    diffs = [d for d in config_differences(meta["config"], run.snapshot()) if d[0].split(".", 1)[1] not in FREE]
    if meta.get("world_size") != world_size:
        diffs.append(("world_size", meta.get("world_size"), world_size))
    if meta.get("data_fingerprint") not in (None, fingerprint):
        diffs.append(("data (dataset contents)", meta.get("data_fingerprint"), fingerprint))
    if not diffs:
        return
    listing = "; ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in diffs)
    never = [d for d in diffs if d[0].startswith("model.") or d[0].split(".", 1)[-1] in NEVER
             or d[0].startswith("data ")]
    if never:
        raise ResumeError(f"cannot resume: the checkpoint was made with other settings ({listing})",
                          "restore the original settings, or start a new run directory (or --resume none)")
    if not allow_changed:
        raise ResumeError(f"resuming with changed settings ({listing})",
                          "pass --allow-changed if this is intended (e.g. a new learning rate or a longer run)")
