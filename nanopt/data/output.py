"""Writing a dataset directory safely: refuse to replace one without --force, stage beside it, publish by rename."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nanopt
from nanopt.data.shards import FORMAT, FORMAT_VERSION, dtype_name, sha256_file, token_dtype
from nanopt.data.tokenizers.tokenizer import NamedTokenizer
from nanopt.errors import DataError, NanoptError
from nanopt.files import link_refused, new_dir, remove_tree
from nanopt.parsing import read_json, save_json

STAGING_MARK = ".partial-"


def check_output(out: Path, force: bool) -> None:
    """An existing dataset is replaced only with --force, and --force never deletes something else; a link is never
    written or replaced through."""
    if out.is_symlink():
        raise link_refused(out, "pass the directory it points to as --out, or another --out")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory", "choose another --out")
    if not force:
        raise DataError(f"{out}: already exists", "pass --force to replace it, or choose another --out")
    if not is_dataset(out):
        raise DataError(f"{out}: exists and is not a nanopt dataset (no meta.json of format {FORMAT}); "
                        "--force only replaces datasets", "delete it yourself or choose another --out")


def is_dataset(path: Path) -> bool:
    try:
        return read_json(path / "meta.json", error=DataError).get("format") == FORMAT
    except (NanoptError, AttributeError):  # none, unreadable (a named pipe: never read), or not an object
        return False


@contextlib.contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A hidden directory beside `out`, renamed to `out` if the block completes and deleted if it does not."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}{STAGING_MARK}{os.getpid()}"
    remove_tree(staging, inside=out.parent)  # our own pid: a leftover of a process that no longer exists
    new_dir(staging)
    try:
        yield staging
        _publish(staging, out)
    except BaseException:
        remove_tree(staging, inside=out.parent, quiet=True)
        raise


def _publish(staging: Path, out: Path) -> None:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():  # --force, checked earlier: move the old dataset aside, then drop it once the new one is in
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        out.rename(old)
        staging.rename(out)
        remove_tree(old, inside=out.parent, quiet=True)
    else:
        staging.rename(out)


def leftover_staging_dirs(out: Path) -> list[Path]:
    """Staging directories of interrupted runs for the same output (killed before they could clean up)."""
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.glob(f".{out.name}{STAGING_MARK}*") if p.is_dir())


def write_meta(root: Path, named: NamedTokenizer, splits: dict[str, Any], source: dict[str, Any],
               settings: dict[str, Any], extra: dict[str, Any], seconds: float) -> dict[str, Any]:
    """meta.json, written last: its presence is what makes the directory a complete dataset."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "vocab_size": named.vocab_size,
        "eos_id": named.eos_id,
        "eos_token": named.eos_token,
        "dtype": dtype_name(token_dtype(named.vocab_size)),
        "tokenizer": {**named.describe(), "file": "tokenizer.json",
                      "sha256": sha256_file(root / "tokenizer.json")},
        "splits": splits,
        "source": source,
        "settings": settings,
        "stats": {**extra, "seconds": round(seconds, 3)},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nanopt_version": nanopt.__version__,
    }
    save_json(root / "meta.json", meta)
    return meta
