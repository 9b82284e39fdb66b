"""Retention: all but the newest `keep_checkpoints` deleted, never the newest, never the one `best` names, never the
imported model a run continues from (`nanopt import`'s step 0: the baseline its evaluations compare against), never one
a reader holds (nanopt.train.checkpoint.hold: it is deleted by the first retention after its hold ends), and
only directories nanopt wrote (named after the step their meta.json records); and the clean-up of the `.tmp-*`
directories a killed process left."""

from __future__ import annotations

from pathlib import Path

from nanopt.errors import NanoptError
from nanopt.files import remove_tree
from nanopt.rundir import step_dir_name
from nanopt.train.checkpoint.hold import is_held
from nanopt.train.checkpoint.meta import checkpoints_dir, is_imported, read_meta, read_pointer
from nanopt.train.checkpoint.read import complete_checkpoints
from nanopt.train.checkpoint.write import remove_step_dir


def apply_retention(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (returns those deleted); never the newest, never the one `best`
    names, never the imported model the run started from, never a held one. Only directories nanopt wrote count,
    named after the step their meta.json records: a foreign or renamed one is never deleted and takes no slot (else
    it would keep one of the `keep` real checkpoints from being kept)."""
    root = checkpoints_dir(run_dir)
    protected = {read_pointer(root, "best"), read_pointer(root, "latest")}
    metas = {path: _meta(path) for path in complete_checkpoints(run_dir)}  # each meta.json read once
    complete = [path for path, meta in metas.items() if _named_after_its_step(path, meta)]
    # The imported model (nanopt import's step 0): re-downloading may not give it back (a revision gone, no
    # network), and a continued run is judged against it.
    doomed = [path for path in complete[:-max(1, keep)] if path.name not in protected
              and not is_imported(metas[path]) and not is_held(run_dir, path.name)]
    # Looked for again once each is renamed: a hold taken meanwhile gives it back (see hold's race note).
    return [path for path in doomed if remove_step_dir(path, spare=lambda name=path.name: is_held(run_dir, name))]


def _meta(path: Path) -> dict:
    """The checkpoint's meta.json, or {} when it cannot be read or is not a JSON object."""
    try:
        meta = read_meta(path / "meta.json")
    except NanoptError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _named_after_its_step(path: Path, meta: dict) -> bool:
    """Whether `path` is named step_dir_name(the step its meta.json records); unreadable or foreign: False."""
    step = meta.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and path.name == step_dir_name(step)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Half-written `.tmp-*` directories left by a killed process are never read; delete them (only real
    directories inside the run's own checkpoints/: nanopt.files.remove_tree)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir() and not root.is_symlink():
        for path in root.glob(".tmp-*"):
            remove_tree(path, inside=root, quiet=True)
