"""The `datasets` library's side of reading a corpus: streams of local files and hub datasets, directories written
by `save_to_disk`, and a text column read from any of them in batches, every failure one DataError.

`datasets` is imported only inside these functions (it is optional: nanopt.data.corpus.plain_files reads text and JSON
files without it) and its log records are held back while a call may fail, so a failure prints nanopt's one line
only. Reading never runs code: `load_from_disk` memory-maps Arrow files and reads JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from nanopt.data.corpus.plain_files import check_column, datasets_installed, needs_datasets
from nanopt.data.corpus.textcheck import first_line
from nanopt.errors import DataError

_ITER_BATCH = 1024  # rows fetched at once from a `datasets` stream
# The files `datasets.load_from_disk` looks for: a DatasetDict's index, else a Dataset's state and info.
SAVED_DICT_FILE, SAVED_STATE_FILE, SAVED_INFO_FILE = "dataset_dict.json", "state.json", "dataset_info.json"



class _DatasetsLogHeld(logging.Handler):
    """The `datasets` library's log records during a call, held back: dropped when the call fails (it logs what
    went wrong, e.g. "Failed to load JSON from file ...", on stderr before raising, and the DataError raised for
    it says the same in nanopt's one line), passed on to its own handlers when the call succeeds."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger("datasets")

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> None:
        self.saved = self.logger.handlers, self.logger.propagate
        self.logger.handlers, self.logger.propagate = [self], False

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> None:
        self.logger.handlers, self.logger.propagate = self.saved
        if kind is None or issubclass(kind, StopIteration):  # the end of a stream is no failure
            for record in self.records:
                self.logger.callHandlers(record)


def load_stream(path: str, what: str, **kwargs: Any) -> Any:
    if not datasets_installed():
        raise needs_datasets(f"opening {what}")
    import datasets

    try:
        with _DatasetsLogHeld():
            return datasets.load_dataset(path, streaming=True, **kwargs)
    except Exception as exc:  # not-found, gated, offline, bad config: `datasets` raises many unrelated types
        raise DataError(f"could not open {what}: {type(exc).__name__}: {first_line(exc)}",
                        "check the name, --config and --split (and the internet connection for hub datasets)"
                        ) from None


def column_texts(stream: Any, column: str, spec: str) -> Iterator[str]:
    names = stream.column_names
    if names is not None:
        check_column(column, names, spec)
        stream = stream.select_columns([column])
    for rows in read_batches(stream, spec):
        if column not in rows:
            check_column(column, list(rows), spec)
        yield from as_texts(rows[column], column)


def read_batches(stream: Any, spec: str) -> Iterator[dict[str, list]]:
    """The stream's row batches; a file that cannot be parsed (or a dropped download) becomes a DataError."""
    rows = iter(stream.iter(batch_size=_ITER_BATCH))
    while True:
        try:
            with _DatasetsLogHeld():
                batch = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow, fsspec and HTTP errors have no common base class
            raise DataError(f"{spec}: reading failed: {type(exc).__name__}: {first_line(exc)}",
                            "check that the files are valid (json: one object per line) and readable") from None
        yield batch


def as_texts(values: Iterable[Any], column: str = "text") -> Iterator[str]:
    """Values of a text column as strings: a missing value is an empty document; anything else is an error."""
    for value in values:
        if isinstance(value, str):
            yield value
        elif value is None:
            yield ""
        else:
            raise DataError(f"column '{column}' holds {type(value).__name__} values, not text",
                            "name the column holding the text with --text-column")


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote (a DatasetDict or a Dataset), by load_from_disk's rule."""
    return path.is_dir() and ((path / SAVED_DICT_FILE).is_file()
                              or ((path / SAVED_STATE_FILE).is_file() and (path / SAVED_INFO_FILE).is_file()))


def load_saved(path: Path, split: str) -> tuple[Any, str | None]:
    """The Dataset that `save_to_disk` wrote at `path` (memory-mapped, not read into memory), and the split taken
    from a DatasetDict (None for a plain Dataset). A missing split is a DataError naming the splits there are."""
    if not datasets_installed():
        raise needs_datasets(f"{path}: reading a dataset saved with save_to_disk")
    import datasets

    try:
        with _DatasetsLogHeld():
            saved = datasets.load_from_disk(str(path))
    except Exception as exc:  # a damaged state.json or Arrow file: `datasets` raises many unrelated types
        raise DataError(f"{path}: could not read the dataset saved there: {type(exc).__name__}: {first_line(exc)}",
                        "save it again with Dataset.save_to_disk, or give the corpus as files") from None
    if not isinstance(saved, datasets.DatasetDict):
        return saved, None
    if split not in saved:
        raise DataError(f"{path}: no split '{split}' in this saved DatasetDict (splits: {', '.join(saved)})",
                        "choose one with --split")
    return saved[split], split
