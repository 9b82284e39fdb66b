"""DCP's `.metadata` index of a sharded checkpoint, read from a file a stranger may have crafted.

The index is a pickle. An unpickler that hands out the real classes it allows still lets the pickle change them:
BUILD with a slot state calls setattr on whatever object is on the stack, a class included, so an index could
rewrite pathlib.PosixPath or DCP's dataclasses for the rest of the process. So reading happens in two stages:

1. The pickle runs against stand-ins. Every global it names (checked against the exact pairs DCP's index is made
   of) resolves to a class made for this one read, whose instances only record the arguments they were called
   with, the state BUILD gave them and the items SETITEMS put in. Nothing else is reachable: no global resolves to
   a real object and persistent ids are refused, so no opcode sequence can touch anything outside the pickle's own
   result. BUILD aimed at a stand-in class is refused (StandInType).
2. nanopt's own code then builds the real metadata objects from what was recorded, each field type- and
   range-checked (shapes are tuples of small non-negative ints, chunks lie inside their tensor, shard paths name
   shard files), so a value DCP later relies on is one nanopt has looked at.

Memory: a pickle builds at most about 90 bytes of Python objects per byte it holds (the densest is one empty
container per byte, all kept on the stack inside one MARK), so the file is read only up to MAX_INDEX_BYTES, 16 MiB,
and reading any index costs at most about 1.5 GB (measured: 1.4 GiB of peak RSS for 16 MiB of empty dicts). A real
index is a few MB and costs a few times its size.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from nanopt.errors import CheckpointError
from nanopt.parsing import read_capped

METADATA_FILE = ".metadata"  # DCP's index of every tensor and the shard file holding each piece
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # one (or more) per rank: __<rank>_<n>.distcp
# A real index holds about 165 bytes per tensor chunk (a 70B model's weights and Adam moments on 8 ranks: 2.7 MiB),
# so 16 MiB takes a 70B model on about 48 ranks. The cap is what bounds memory: see the module's docstring.
MAX_INDEX_BYTES = 16 << 20
MAX_DIMS = 64  # torch allows 64 dimensions
MAX_EXTENT = 1 << 48  # elements along one dimension or offset into it: far above any tensor that fits in memory
HINT = "use another checkpoint"

# Every global a DCP index may name, as exact (module, name) pairs: DCP's metadata dataclasses, its storage info,
# torch.Size and dtypes, the layout helper, paths. Never a dotted name: a protocol-4 pickle resolves "os.system"
# inside any module that imports os. They name stand-ins only (see the module's docstring), never these objects.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
INDEX_GLOBALS = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                         "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})


def is_dtype_name(module: str, name: str) -> bool:
    """("torch", "bfloat16") and the like: a plain attribute of torch that is a dtype (a value, not a callable)."""
    return module == "torch" and isinstance(vars(torch).get(name), torch.dtype)  # vars: no lazy __getattr__ import


class Recorded:
    """What the pickle built from a global: the arguments it was called with (REDUCE, NEWOBJ), the state BUILD gave
    it and the items SETITEM(S) put in. Each read subclasses it once per global; `named` says which."""

    __slots__ = ("args", "state", "items")
    named: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any) -> Recorded:
        self = object.__new__(cls)
        self.args, self.state, self.items = args, None, {}
        return self

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value


class StandInType(type):
    """The type of each stand-in class. BUILD aimed at a class (the pickle's way to setattr on it) looks its
    __setstate__ up here first, as a data descriptor of the metaclass, and is refused in words."""

    @property
    def __setstate__(cls) -> Any:
        def refuse(state: Any) -> None:
            raise pickle.UnpicklingError(f"it sets state on the class {'.'.join(cls.named)} itself, which no index "
                                         "does")
        return refuse


class RecordingUnpickler(pickle.Unpickler):
    """Resolves each allowed global to a stand-in class made for this unpickler (the same one each time it is
    named, so the second stage can tell them apart), and everything else to an error. The extension registry's
    EXT1/2/4 come through find_class; persistent ids are refused by the base class."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.stand_ins: dict[tuple[str, str], type[Recorded]] = {}

    def find_class(self, module: str, name: str) -> type[Recorded]:
        if not ((module, name) in INDEX_GLOBALS or is_dtype_name(module, name)):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a shard index")
        if (module, name) not in self.stand_ins:
            self.stand_ins[module, name] = StandInType(name, (Recorded,), {"__slots__": (), "named": (module, name)})
        return self.stand_ins[module, name]


class Malformed(ValueError):
    """A recorded value that is not what a DCP index holds there; the text names where and what."""


def read_index(directory: Path) -> Any:
    """The checkpoint's index as DCP's own Metadata, built by nanopt from the checked contents of the file."""
    path = directory / METADATA_FILE
    data = read_capped(path, MAX_INDEX_BYTES, CheckpointError, HINT, "shard index")
    try:
        recorded = RecordingUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # truncated, foreign or crafted: pickle, EOF, recursion, ... all mean "unreadable"
        raise CheckpointError(f"{path}: not a readable shard index ({str(exc)[:120]})", HINT) from None
    try:
        return _metadata(recorded)
    except Malformed as exc:
        raise CheckpointError(f"{path}: not a shard index nanopt can use ({str(exc)[:200]})", HINT) from None


# --- the second stage: real metadata objects from what was recorded, each field checked -----------------------

def _made(value: Any, module: str, name: str, where: str) -> Recorded:
    """`value` as an instance the pickle built from (module, name)."""
    if not (isinstance(value, Recorded) and type(value).named == (module, name)):
        raise Malformed(f"{where} is {_what(value)}, not a {name}")
    return value


def _what(value: Any) -> str:
    """A value from the pickle, in a few words: never str() of it, which can be huge or nested past recursion."""
    if type(value) is int and abs(value) < 10**15 or type(value) in (bool, type(None)):
        return repr(value)
    if type(value) is str:
        return repr(value[:40])
    if isinstance(value, Recorded):
        return f"a {type(value).named[1]}"
    if isinstance(value, type) and issubclass(value, Recorded):
        return f"the global {'.'.join(value.named)}"
    return f"a {type(value).__name__}"


def _fields(value: Any, module: str, name: str, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    """A dataclass the pickle built as NEWOBJ() then BUILD(state): its state as {field: value}, only known fields.
    The state may come as a dict, or as (dict or None, slot dict) for a class with slots."""
    made = _made(value, module, name, where)
    state = made.state
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) \
            and isinstance(state[1], dict):
        state = {**(state[0] or {}), **state[1]}
    if made.args or made.items or not isinstance(state, (dict, type(None))):
        raise Malformed(f"{where} ({name}) is not built from a table of its fields")
    state = state or {}
    unknown = [key for key in state if key not in allowed]
    if unknown:
        raise Malformed(f"{where} ({name}) has a field {_what(unknown[0])} this torch does not know")
    return state


def _allowed(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _int(value: Any, where: str, low: int = 0, high: int = MAX_EXTENT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise Malformed(f"{where} is {_what(value)}, not a whole number from {low} to {high}")
    return value


def _str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise Malformed(f"{where} is {_what(value)}, not text")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise Malformed(f"{where} is {_what(value)}, not true or false")
    return value


def _size(value: Any, where: str) -> torch.Size:
    made = _made(value, "torch", "Size", where)
    dims = made.args[0] if len(made.args) == 1 and not made.items and made.state is None else None
    if type(dims) is not tuple or len(dims) > MAX_DIMS:
        raise Malformed(f"{where} is not a tuple of at most {MAX_DIMS} sizes")
    return torch.Size([_int(d, f"{where}[{i}]") for i, d in enumerate(dims)])


def _called_with_one(value: Any, module: str, name: str, where: str) -> Any:
    made = _made(value, module, name, where)
    if len(made.args) != 1 or made.items or made.state is not None:
        raise Malformed(f"{where} ({name}) is not built from one value")
    return made.args[0]


def _dtype(value: Any, where: str) -> torch.dtype:
    if not (isinstance(value, type) and issubclass(value, Recorded) and is_dtype_name(*value.named)):
        raise Malformed(f"{where} is {_what(value)}, not a torch dtype")
    return vars(torch)[value.named[1]]


def _layout(value: Any, where: str) -> torch.layout:
    name = _called_with_one(value, "torch.serialization", "_get_layout", where)
    if name != "torch.strided":  # DCP stores only dense tensors; nanopt writes nothing else
        raise Malformed(f"{where} is {_what(name)}, not torch.strided")
    return torch.strided


def _memory_format(value: Any, where: str) -> torch.memory_format:
    code = _called_with_one(value, _DCP_METADATA, "_MEM_FORMAT_ENCODING", where)
    formats = (torch.contiguous_format, torch.channels_last, torch.preserve_format)  # the enum's values 0, 1, 2
    return formats[_int(code, where, high=len(formats) - 1)]


def _properties(value: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    made = _made(value, _DCP_METADATA, "TensorProperties", where)
    state = made.state
    if made.args or made.items or type(state) is not tuple or len(state) != 5:
        raise Malformed(f"{where} (TensorProperties) is not its five fields")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    return TensorProperties(dtype=_dtype(dtype, f"{where}.dtype"), layout=_layout(layout, f"{where}.layout"),
                            requires_grad=_bool(requires_grad, f"{where}.requires_grad"),
                            memory_format=_memory_format(memory_format, f"{where}.memory_format"),
                            pin_memory=_bool(pin_memory, f"{where}.pin_memory"))


def _chunk(value: Any, size: torch.Size, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    fields = _fields(value, _DCP_METADATA, "ChunkStorageMetadata", _allowed(ChunkStorageMetadata), where)
    offsets, sizes = _size(fields.get("offsets"), f"{where}.offsets"), _size(fields.get("sizes"), f"{where}.sizes")
    inside = len(offsets) == len(sizes) == len(size) and all(
        o + s <= d for o, s, d in zip(offsets, sizes, size, strict=True))
    if not inside:
        raise Malformed(f"{where} lies outside its tensor of shape {tuple(size)}")
    return ChunkStorageMetadata(offsets=offsets, sizes=sizes)


def _entry(value: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if isinstance(value, Recorded) and type(value).named == (_DCP_METADATA, "BytesStorageMetadata"):
        _fields(value, _DCP_METADATA, "BytesStorageMetadata", (), where)
        return BytesStorageMetadata()
    fields = _fields(value, _DCP_METADATA, "TensorStorageMetadata", _allowed(TensorStorageMetadata), where)
    size = _size(fields.get("size"), f"{where}.size")
    chunks = fields.get("chunks")
    if type(chunks) is not list:
        raise Malformed(f"{where}.chunks is {_what(chunks)}, not a list")
    if math.prod(size) and not chunks:
        raise Malformed(f"{where} has no chunks")
    return TensorStorageMetadata(properties=_properties(fields.get("properties"), f"{where}.properties"), size=size,
                                 chunks=[_chunk(c, size, f"{where}.chunks[{i}]") for i, c in enumerate(chunks)])


def _table(value: Any, where: str) -> dict:
    """A dict, or an OrderedDict the pickle built (REDUCE with no arguments, then SETITEMS)."""
    if type(value) is dict:
        return value
    if isinstance(value, Recorded) and type(value).named == ("collections", "OrderedDict") \
            and not value.args and value.state is None:
        return value.items
    raise Malformed(f"{where} is {_what(value)}, not a table")


def _entries(value: Any) -> dict[str, Any]:
    table = _table(value, "state_dict_metadata")
    return {_str(key, "a state_dict_metadata key"): _entry(entry, f"state_dict_metadata[{key[:80]!r}]")
            for key, entry in table.items()}


def _planner_data(value: Any) -> dict[str, tuple] | None:
    """DCP's flattening map, {flat key: the path of keys to it}, or nothing."""
    if value is None:
        return None
    table = _table(value, "planner_data")
    checked = {}
    for key, path in table.items():
        where = f"planner_data[{_str(key, 'a planner_data key')[:80]!r}]"
        if type(path) is not tuple or len(path) > MAX_DIMS or any(type(p) not in (str, int) for p in path):
            raise Malformed(f"{where} is not a path of names and positions")
        checked[key] = path
    return checked


def _storage_key(value: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    fields = _fields(value, _DCP_METADATA, "MetadataIndex", _allowed(MetadataIndex), where)
    offset = fields.get("offset")
    index = fields.get("index")
    return MetadataIndex(fqn=_str(fields.get("fqn"), f"{where}.fqn"),
                         offset=None if offset is None else _size(offset, f"{where}.offset"),
                         index=None if index is None else _int(index, f"{where}.index"))


def _storage_info(value: Any, where: str) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    fields = _fields(value, "torch.distributed.checkpoint.filesystem", "_StorageInfo", _allowed(_StorageInfo), where)
    path = _str(fields.get("relative_path"), f"{where}.relative_path")
    if SHARD_FILE.fullmatch(path) is None:
        raise Malformed(f"{where}.relative_path {path[:80]!r} is not a shard file's name")
    info = {"relative_path": path, "offset": _int(fields.get("offset"), f"{where}.offset", high=1 << 62),
            "length": _int(fields.get("length"), f"{where}.length", high=1 << 62)}
    descriptors = fields.get("transform_descriptors")
    if descriptors is not None:
        if type(descriptors) not in (list, tuple):
            raise Malformed(f"{where}.transform_descriptors is {_what(descriptors)}, not a list")
        info["transform_descriptors"] = [_str(d, f"{where}.transform_descriptors") for d in descriptors]
    return _StorageInfo(**info)


def _storage_data(value: Any) -> dict:
    checked = {}
    for number, (key, info) in enumerate(_table(value, "storage_data").items()):
        real = _storage_key(key, f"storage_data key {number}")
        if real in checked:
            raise Malformed(f"storage_data names {real.fqn[:80]!r} at offset {tuple(real.offset or ())} twice")
        checked[real] = _storage_info(info, f"storage_data[{real.fqn[:80]!r}]")
    return checked


def _checkpoint_id(value: Any) -> str | None:
    """A path as text: DCP keeps it for the record; nanopt passes its own on every read."""
    for module, name in (("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                         ("pathlib", "PureWindowsPath")):
        if isinstance(value, Recorded) and type(value).named == (module, name):
            if value.items or value.state is not None or any(type(a) is not str for a in value.args):
                raise Malformed("storage_meta.checkpoint_id is not a path")
            return str((PureWindowsPath if "Windows" in name else PurePosixPath)(*value.args))
    return _optional_str(value, "storage_meta.checkpoint_id")


def _storage_meta(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    if value is None:
        return None
    fields = _fields(value, _DCP_METADATA, "StorageMeta", _allowed(StorageMeta), "storage_meta")
    modules = fields.get("modules", [])
    if type(modules) is not list:
        raise Malformed(f"storage_meta.modules is {_what(modules)}, not a list")
    return StorageMeta(checkpoint_id=_checkpoint_id(fields.get("checkpoint_id")),
                       save_id=_optional_str(fields.get("save_id"), "storage_meta.save_id"),
                       load_id=_optional_str(fields.get("load_id"), "storage_meta.load_id"),
                       modules=[_str(m, "storage_meta.modules") for m in modules])


def _metadata(recorded: Any) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    # `version` (DCP's format version, newer torch) is kept where this torch has the field, else left out: it
    # names the format, and the entries it describes are checked one by one all the same.
    allowed = _allowed(Metadata)
    fields = _fields(recorded, _DCP_METADATA, "Metadata", (*allowed, "version"), "the index")
    storage = fields.get("storage_data")
    built = {"state_dict_metadata": _entries(fields.get("state_dict_metadata")),
             "planner_data": _planner_data(fields.get("planner_data")),
             "storage_data": None if storage is None else _storage_data(storage),
             "storage_meta": _storage_meta(fields.get("storage_meta"))}
    if "version" in allowed:
        built["version"] = _optional_str(fields.get("version"), "version")
    return Metadata(**built)
