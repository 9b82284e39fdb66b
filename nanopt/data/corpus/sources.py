"""Corpus sources. Each yields documents as strings, in a deterministic order, without holding the corpus.

- The built-in corpus: the Python standard library installed on this machine (its .py sources, whose docstrings are
  its documentation, and any .txt / .rst files shipped with it), one document per file, in sorted path order. It
  needs no download, so the CPU demo works offline.
- Local files, folders and globs (txt, json / jsonl, parquet, optionally .gz / .bz2 / .xz / .zst compressed), read
  through the same `datasets.load_dataset(..., streaming=True)` calls as a hub dataset; without `datasets` installed,
  text and JSON files are read by nanopt.data.corpus.plain_files, into the same documents in the same order.
- A directory written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict and its `--split`), read as
  `datasets.load_from_disk` reads it: memory-mapped Arrow, never loaded whole.
- A Hugging Face hub dataset by name, streamed (`streaming=True`), so a 100B-token corpus is never downloaded whole.

Local text and JSON files (and the built-in corpus) are checked before anything is read for tokenizing
(`check_text_file`): a file that is not text at all is refused, and bytes that are not UTF-8 are counted per file,
then either replaced with U+FFFD as the file is read or, with `--on-decode-error refuse`, refused at the first one.
Parquet and hub datasets need no check: Arrow strings are UTF-8 by construction.
"""

from __future__ import annotations

import glob
import platform
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nanopt.data.corpus.hf_datasets import as_texts, column_texts, is_saved_dataset, load_saved, load_stream
from nanopt.data.corpus.hub import hub_unreachable
from nanopt.data.corpus.plain_files import datasets_installed, needs_datasets, plain_values
from nanopt.data.corpus.textcheck import COMPRESSIONS, TextFile
from nanopt.errors import ConfigError, DataError

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".rst": "text", ".json": "json", ".jsonl": "json",
            ".ndjson": "json", ".parquet": "parquet"}
SAMPLE_BY = ("document", "paragraph", "line")
# `datasets`' packaged builders: given as a dataset name without data_files, each reads the working directory.
DATASETS_BUILDERS = frozenset({"arrow", "audiofolder", "csv", "imagefolder", "json", "pandas", "parquet", "sql",
                               "text", "videofolder", "webdataset", "xml"})
_EXAMPLE_SUFFIX = {"text": "txt", "parquet": "parquet"}
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class SizeHint:
    """What is known up front about a source's size, for the progress bar's ETA."""

    bytes: int | None = None
    documents: int | None = None


class Source(Protocol):
    kind: str

    def texts(self) -> Iterator[str]: ...

    # The files texts() decodes, checked before reading (check_text_file); a source of text already in memory (a
    # test's, a benchmark's) may leave it out.
    def text_files(self) -> list[TextFile]: ...

    def describe(self) -> dict[str, Any]: ...

    def size_hint(self) -> SizeHint: ...


def open_source(spec: str | None, config: str | None = None, split: str = "train", text_column: str = "text",
                sample_by: str = "document") -> Source:
    """The built-in corpus when spec is None, a `save_to_disk` directory, local files when spec exists on disk (or
    is a glob), else the hub."""
    if sample_by not in SAMPLE_BY:
        raise ConfigError(f"--sample-by {sample_by!r} is not one of {', '.join(SAMPLE_BY)}",
                          "document: one document per text file; paragraph: split at blank lines; line: per line")
    if spec is None:
        return StdlibSource()
    if _GLOB_CHARS.search(spec) or Path(spec).expanduser().exists():
        if config is not None:
            raise ConfigError("--config applies to Hugging Face hub datasets only", "remove --config")
        if is_saved_dataset(Path(spec).expanduser()):
            return SavedSource(spec, split, text_column)
        return FileSource(spec, text_column, sample_by)
    if spec.lower() in DATASETS_BUILDERS:  # `datasets` would scan the working directory for files, then fail
        suffix = _EXAMPLE_SUFFIX.get(spec.lower(), "jsonl")
        raise DataError(f"{spec}: a `datasets` builder name, not a dataset: it reads files, and none were named",
                        f"pass the files themselves, e.g. nanopt tokenize 'corpus/*.{suffix}' --out DIR (.txt, "
                        ".json/.jsonl and .parquet files, folders and globs go through the same builders; convert "
                        "other formats to one of these)")
    if _builder_for(Path(spec)) is not None or not _HUB_NAME.match(spec):
        raise DataError(f"{spec}: no such file or directory", "check the path, or give a Hugging Face dataset name "
                        "such as HuggingFaceFW/fineweb-edu")
    return HubSource(spec, config, split, text_column)


# ---------------------------------------------------------------------------------------------- built-in corpus


class StdlibSource:
    """The installed Python standard library: one document per .py / .txt / .rst file, sorted by path.

    Left out: site-packages (third-party code that differs per machine), test suites (half the bytes, mostly
    fixtures and deliberately odd encodings), and _sysconfigdata* (this machine's build paths).
    """

    kind = "builtin"
    SUFFIXES = (".py", ".txt", ".rst")
    SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or sysconfig.get_paths()["stdlib"])
        self._files: list[Path] | None = None

    def files(self) -> list[Path]:
        if self._files is None:
            found = (p for p in self.root.rglob("*") if p.suffix in self.SUFFIXES and self._wanted(p))
            self._files = sorted(found, key=lambda p: p.relative_to(self.root).as_posix())
        return self._files

    def _wanted(self, path: Path) -> bool:
        parts = path.relative_to(self.root).parts
        return (not self.SKIP_DIRS.intersection(parts[:-1]) and not parts[0].startswith("config-")
                and not path.name.startswith("_sysconfigdata") and path.is_file())

    def texts(self) -> Iterator[str]:
        for path in self.files():
            # errors="replace": undecodable bytes (counted and warned about by check_text_file) become U+FFFD
            yield path.read_text(encoding="utf-8", errors="replace")

    def text_files(self) -> list[TextFile]:
        return [TextFile(p, p.relative_to(self.root).as_posix()) for p in self.files()]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": "python-stdlib", "python": platform.python_version(),
                "root": str(self.root), "files": len(self.files()), "bytes": self._total_bytes()}

    def size_hint(self) -> SizeHint:
        return SizeHint(bytes=self._total_bytes(), documents=len(self.files()))

    def _total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files())


# ---------------------------------------------------------------------------------------------- local files


class FileSource:
    """Local text / JSON / parquet files; a folder means every supported file under it, sorted by path."""

    kind = "files"

    def __init__(self, spec: str, text_column: str = "text", sample_by: str = "document") -> None:
        self.spec, self.text_column, self.sample_by = spec, text_column, sample_by
        self.groups = _group_by_builder(_resolve_files(spec), spec)
        if "parquet" in self.groups and not datasets_installed():
            raise needs_datasets(f"{spec}: reading parquet files")

    def texts(self) -> Iterator[str]:
        plain = not datasets_installed()
        for builder, files in self.groups.items():
            column = "text" if builder == "text" else self.text_column
            if plain:
                yield from as_texts(plain_values(builder, files, column, self.sample_by, self.spec), column)
                continue
            stream = load_stream(builder, f"files {self.spec}", data_files=[str(f) for f in files], split="train",
                                  **_builder_options(builder, self.sample_by))
            yield from column_texts(stream, column, self.spec)

    def text_files(self) -> list[TextFile]:
        """Text and JSON files in reading order; parquet holds Arrow strings, which are UTF-8 by construction."""
        return [TextFile(f, str(f), can_replace=not (builder == "text" and f.suffix.lower() in COMPRESSIONS))
                for builder, files in self.groups.items() if builder != "parquet" for f in files]

    def describe(self) -> dict[str, Any]:
        files = [f for group in self.groups.values() for f in group]
        return {"kind": self.kind, "spec": self.spec, "formats": sorted(self.groups), "files": len(files),
                "bytes": sum(f.stat().st_size for f in files), "text_column": self.text_column,
                "sample_by": self.sample_by}

    def size_hint(self) -> SizeHint:
        if set(self.groups) == {"parquet"}:
            import pyarrow.parquet as pq

            return SizeHint(documents=sum(pq.read_metadata(f).num_rows for f in self.groups["parquet"]))
        if set(self.groups) == {"text"} and self.sample_by == "document":
            return SizeHint(documents=len(self.groups["text"]))
        return SizeHint()


def _resolve_files(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        candidates = [p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))]
    else:
        candidates = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    files = sorted((p for p in candidates if _builder_for(p)), key=lambda p: p.as_posix())
    if not files:
        raise DataError(f"{spec}: no .txt, .json, .jsonl or .parquet files found",
                        "point at a file, a folder or a glob such as 'corpus/*.jsonl'")
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def _group_by_builder(files: list[Path], spec: str) -> dict[str, list[Path]]:
    groups: dict[str, list[Path]] = {}
    for path in files:
        builder = _builder_for(path)
        if builder is None:
            raise DataError(f"{path}: unsupported file type", "use .txt, .json, .jsonl or .parquet files")
        groups.setdefault(builder, []).append(path)
    return dict(sorted(groups.items()))  # a fixed order of formats for a mixed folder


def _builder_options(builder: str, sample_by: str) -> dict[str, Any]:
    """Undecodable bytes become U+FFFD, as check_text_file counted them (or it refused the file already)."""
    if builder == "text":
        return {"sample_by": sample_by, "keep_linebreaks": True, "encoding_errors": "replace"}
    if builder == "json":
        # `datasets` passes "utf-8" JSON to pyarrow undecoded, which rejects the whole file at the first bad byte;
        # for any other codec name it decodes with encoding_errors first, so name the same codec "utf8".
        return {"encoding": "utf8", "encoding_errors": "replace"}
    return {}


# ---------------------------------------------------------------------------------------------- save_to_disk


class SavedSource:
    """A directory `Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote: its rows in stored order (a
    DatasetDict: the `split` one). Arrow strings are UTF-8 by construction, so there is no file to check."""

    kind = "saved"

    def __init__(self, spec: str, split: str, text_column: str) -> None:
        self.spec, self.text_column = spec, text_column
        self.dataset, self.split = load_saved(Path(spec).expanduser(), split)

    def texts(self) -> Iterator[str]:
        yield from column_texts(self.dataset, self.text_column, self.spec)

    def text_files(self) -> list[TextFile]:
        return []

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.spec, "split": self.split, "rows": len(self.dataset),
                "text_column": self.text_column}

    def size_hint(self) -> SizeHint:
        return SizeHint(documents=len(self.dataset))


# ---------------------------------------------------------------------------------------------- the hub


class HubSource:
    """A Hugging Face hub dataset, streamed split by split; the hub's own shard order makes it deterministic."""

    kind = "hub"

    def __init__(self, name: str, config: str | None, split: str, text_column: str) -> None:
        self.name, self.config, self.split, self.text_column = name, config, split, text_column
        self._stream: Any = None

    def _open(self) -> Any:
        if self._stream is None:
            if not datasets_installed():  # the first thing to fix: without `datasets` no hub dataset reads at all
                raise needs_datasets(f"opening dataset {self.name}")
            unreachable = None if Path(self.name).exists() else hub_unreachable()  # a local path needs no hub
            if unreachable is not None:  # at once, not after huggingface_hub's 23 s of retries
                raise DataError(f"could not open dataset {self.name}: the Hugging Face hub cannot be reached "
                                f"({unreachable}), and a streamed dataset reads it as it goes",
                                "tokenize local files instead (a file, folder or glob, or a save_to_disk directory)")
            self._stream = load_stream(self.name, f"dataset {self.name}", name=self.config, split=self.split)
        return self._stream

    def texts(self) -> Iterator[str]:
        yield from column_texts(self._open(), self.text_column, self.name)

    def text_files(self) -> list[TextFile]:
        return []  # remote: `datasets` decodes its files strictly (a bad byte is a read error), or reads Arrow strings

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "config": self.config, "split": self.split,
                "text_column": self.text_column}

    def size_hint(self) -> SizeHint:
        splits = getattr(self._open().info, "splits", None) or {}
        info = splits.get(self.split) if hasattr(splits, "get") else None
        return SizeHint(documents=getattr(info, "num_examples", None) or None)


class TextListSource:
    """Documents already in memory (tests, benchmarks): no I/O, so only tokenizing and writing are measured."""

    kind = "memory"

    def __init__(self, texts: Iterable[str], name: str = "memory") -> None:
        self._texts, self.name = list(texts), name

    def texts(self) -> Iterator[str]:
        return iter(self._texts)

    def text_files(self) -> list[TextFile]:
        return []

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "documents": len(self._texts)}

    def size_hint(self) -> SizeHint:
        return SizeHint(documents=len(self._texts))
