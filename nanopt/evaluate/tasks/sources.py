"""A task's records: from the Hugging Face hub through `datasets` (the harness's dataset, config and split), or,
with --task-data DIR, from DIR/TASK.jsonl (one record a line, in the hub dataset's schema) or DIR/TASK, a folder
that `datasets`' save_to_disk wrote, for machines without the hub.

Nothing here runs code from a dataset: no loading script is ever trusted (`datasets` 4 runs none), a jsonl is
read as a stranger's file (regular files only, size-capped, each line parsed as plain JSON).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.errors import DataError
from nanopt.evaluate.tasks.catalog import Task
from nanopt.parsing import parse_json_text, read_capped
from nanopt.shown import printable

MAX_TASK_FILE_BYTES = 1 << 30  # the largest task here (HellaSwag validation) is about 50 MB as jsonl
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


def read_jsonl(path: Path, limit: int | None) -> list[Any]:
    data = read_capped(path, MAX_TASK_FILE_BYTES, DataError, TASK_DATA_HINT, "task file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text", "save the task file as UTF-8 JSON lines") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(records) >= limit:
            break
        if line.strip():
            records.append(parse_json_text(line, f"{path} line {number}", error=DataError,
                                           hint="write one JSON object a line"))
    if not records:
        raise DataError(f"{path}: no records", TASK_DATA_HINT)
    return records


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
    return list(rows), where


def _from_saved(task: Task, folder: Path, limit: int | None) -> list[Any]:
    datasets = _datasets()
    try:
        rows = datasets.load_from_disk(str(folder))
        if isinstance(rows, datasets.DatasetDict):
            rows = rows[task.split]
    except Exception as exc:
        raise DataError(f"{folder}: not a `datasets` save_to_disk folder with a {task.split} split "
                        f"({printable(str(exc))[:160]})", TASK_DATA_HINT) from None
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return list(rows)
