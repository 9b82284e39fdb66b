"""A task's records: from the Hugging Face hub through `datasets` (the harness's dataset, config and split), or,
with --task-data DIR, from DIR/TASK.jsonl (one record a line, in the hub dataset's schema) or DIR/TASK, a folder
that `datasets`' save_to_disk wrote, for machines without the hub.

Nothing here runs code from a dataset: no loading script is ever trusted (`datasets` 4 runs none), a jsonl is
read as a stranger's file (regular files only, size-capped, each line parsed as plain JSON).

Memory, whatever the files hold: a jsonl is streamed a line at a time and a line longer than MAX_RECORD_BYTES is
refused before it is held whole, so reading costs one line (at most MAX_RECORD_BYTES, and its text once decoded)
plus the records kept; a save_to_disk folder's files may total at most MAX_TASK_FILE_BYTES (its rows are
materialised one at a time, so a row never costs more than the files hold); and the records kept, from any source, are
measured as they are kept and refused past MAX_KEPT_BYTES (`_footprint`): parsed JSON may take twenty times its
text (`[[],[],...]`), so the file's size alone would not bound them.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from nanopt.errors import DataError
from nanopt.evaluate.tasks.catalog import Task
from nanopt.files import file_kind
from nanopt.parsing import open_regular, parse_json_text, path_kind
from nanopt.untrusted_text import printable

MAX_TASK_FILE_BYTES = 1 << 30  # the largest task here (HellaSwag validation) is about 12 MB as jsonl
# The longest record of any task here is a few KiB (a LAMBADA passage; a HellaSwag context with its four endings):
# 1 MiB is hundreds of times that, so no benchmark record meets the cap, and a longer line is not a record.
MAX_RECORD_BYTES = 1 << 20
# What the kept records may take in memory as Python objects: HellaSwag validation's take about 30 MB (some 2.5
# times their jsonl), so this is far above any real task and far below what a machine that evaluates has.
MAX_KEPT_BYTES = 1 << 30
TASK_DATA_HINT = "pass --task-data DIR holding TASK.jsonl per task, one record a line in the hub dataset's schema"


def load_records(task: Task, task_data: Path | None, limit: int | None) -> tuple[list[Any], str]:
    """The first `limit` records (all with None) of the split the harness scores, and where they came from."""
    if task_data is None:
        return _from_hub(task, limit)
    saved = Path(task_data) / task.name
    if saved.is_dir():
        return _from_saved(task, saved, limit), str(saved)
    path = Path(task_data) / f"{task.name}.jsonl"
    return read_jsonl(path, limit), str(path)


def check_task_files(names: Iterable[str], task_data: Path | None) -> None:
    """DataError, one line, unless every task has its data in --task-data (TASK/ or a readable TASK.jsonl): checked
    before a checkpoint is read, since the tasks are scored one after another once the model is loaded (a missing
    last file would otherwise be found only after the others were scored). The hub is asked only when scoring."""
    if task_data is None:
        return
    missing = []
    for name in names:
        path = Path(task_data) / f"{name}.jsonl"
        if path_kind(Path(task_data) / name, DataError, TASK_DATA_HINT) == "dir":
            continue  # a save_to_disk folder: its files are checked as it is loaded
        if path_kind(path, DataError, TASK_DATA_HINT) == "missing":
            missing.append(path)
        else:  # a pipe, a directory, no permission: one line, as the reader would say it
            open_regular(path, DataError, TASK_DATA_HINT, "task file").close()
    if missing:
        also = ", ".join(path.stem + "'s" for path in missing[1:])
        raise DataError(f"{missing[0]}: task file not found" + (f" (nor {also})" if also else ""), TASK_DATA_HINT)


def read_jsonl(path: Path, limit: int | None) -> list[Any]:
    """The first `limit` records of a jsonl task file (see the module docstring for what it may cost)."""
    with open_regular(path, DataError, TASK_DATA_HINT, "task file") as f:
        if (size := os.fstat(f.fileno()).st_size) > MAX_TASK_FILE_BYTES:  # refused from its size, unread
            raise _too_large(path, size)
        records = _kept((_parse(path, number, line) for number, line in _lines(f, path) if line.strip()),
                        str(path), limit)
    if not records:
        raise DataError(f"{path}: no records", TASK_DATA_HINT)
    return records


def check_jsonl(path: Path) -> None:
    """DataError unless every line of a jsonl task file passes read_jsonl's bounds and parses, keeping no record:
    for lm-evaluation-harness, which reads the file itself and whole, so nothing nanopt would refuse reaches it."""
    with open_regular(path, DataError, TASK_DATA_HINT, "task file") as f:
        if (size := os.fstat(f.fileno()).st_size) > MAX_TASK_FILE_BYTES:
            raise _too_large(path, size)
        for number, line in _lines(f, path):
            if line.strip():
                _parse(path, number, line)


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) per line, each read at most MAX_RECORD_BYTES (and its line break) at a time, and at
    most MAX_TASK_FILE_BYTES in all (should the file grow while it is read)."""
    number = read = 0
    while line := f.readline(MAX_RECORD_BYTES + 2):
        number, read = number + 1, read + len(line)
        if read > MAX_TASK_FILE_BYTES:
            raise _too_large(path, read)
        if len(line.rstrip(b"\r\n")) > MAX_RECORD_BYTES:
            raise DataError(f"{path} line {number}: longer than {MAX_RECORD_BYTES >> 20} MiB, which no record of a "
                            "benchmark is", "check that it is the task's jsonl, one record a line")
        try:
            yield number, line.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path} line {number}: not UTF-8 text",
                            "save the task file as UTF-8 JSON lines") from None


def _too_large(path: Path, size: int) -> DataError:
    return DataError(f"{path}: {size:,} bytes, more than the {MAX_TASK_FILE_BYTES >> 20} MiB a task file nanopt "
                     "reads may hold", TASK_DATA_HINT)


def _parse(path: Path, number: int, line: str) -> Any:
    return parse_json_text(line, f"{path} line {number}", error=DataError, hint="write one JSON object a line")


def _kept(records: Iterable[Any], where: str, limit: int | None) -> list[Any]:
    """The first `limit` of `records` (all with None), consumed one at a time; DataError once those kept take more
    than MAX_KEPT_BYTES."""
    kept: list[Any] = []
    total = 0
    for record in records:
        if limit is not None and len(kept) >= limit:
            break
        total += _footprint(record)
        if total > MAX_KEPT_BYTES:
            raise DataError(f"{where}: its first {len(kept) + 1:,} records take more than "
                            f"{MAX_KEPT_BYTES >> 20} MiB in memory, more than any benchmark's",
                            "check the task file, or score its first records with --limit N")
        kept.append(record)
    return kept


def _footprint(value: Any) -> int:
    """The bytes a record takes as Python objects (containers and what they hold); a loop, so any depth is safe."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("downstream tasks from the hub need the `datasets` package, which is not installed",
                        f"pip install datasets, or {TASK_DATA_HINT}") from None
    return datasets


def _from_hub(task: Task, limit: int | None) -> tuple[list[Any], str]:
    datasets = _datasets()
    where = f"{task.path}" + (f" ({task.config})" if task.config else "") + f" split {task.split}"
    split = task.split if limit is None else f"{task.split}[:{limit}]"
    try:
        rows = datasets.load_dataset(task.path, task.config, split=split)
    except Exception as exc:  # no network, a renamed dataset, a hub error: each is one line, never a traceback
        reason = printable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:200]
        raise DataError(f"{task.name}: could not load {where} from the hub: {reason}",
                        f"check the network (or HF_DATASETS_OFFLINE), or {TASK_DATA_HINT}") from None
    return _kept(rows, where, None), where


def _from_saved(task: Task, folder: Path, limit: int | None) -> list[Any]:
    datasets = _datasets()
    _check_saved_folder(folder)
    try:
        rows = datasets.load_from_disk(str(folder))
        if isinstance(rows, datasets.DatasetDict):
            rows = rows[task.split]
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        return _kept(rows, str(folder), None)
    except DataError:
        raise
    except Exception as exc:  # a folder save_to_disk did not write, or Arrow data that cannot be read
        raise DataError(f"{folder}: not a `datasets` save_to_disk folder with a {task.split} split "
                        f"({printable(str(exc))[:160]})", TASK_DATA_HINT) from None


def _check_saved_folder(folder: Path) -> None:
    """The folder holds only directories and regular files (`datasets` opens its JSON files plainly: a named pipe
    would block it), totalling at most MAX_TASK_FILE_BYTES as a jsonl may, so no row it reads is larger."""
    total = 0
    try:
        for path in folder.rglob("*"):
            mode, size = (st := path.stat()).st_mode, st.st_size
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise DataError(f"{path}: is {file_kind(mode)}, not part of a save_to_disk folder", TASK_DATA_HINT)
            total += size if stat.S_ISREG(mode) else 0
    except OSError as exc:  # a dangling link, no permission
        raise DataError(f"{folder}: cannot read {exc.filename} ({exc.strerror})", TASK_DATA_HINT) from None
    if total > MAX_TASK_FILE_BYTES:
        raise DataError(f"{folder}: its files hold {total:,} bytes, more than the {MAX_TASK_FILE_BYTES >> 20} MiB "
                        "a task's data may", TASK_DATA_HINT)
