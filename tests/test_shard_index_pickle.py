"""The sharded checkpoint's `.metadata` index is a pickle (torch.distributed.checkpoint's format): nanopt reads it
with an unpickler that resolves exact (module, name) pairs only, each to a stand-in. These tests craft indexes the
way an attacker would (dotted names through GLOBAL and STACK_GLOBAL, the extension registry, persistent ids) and
walk every attribute reachable from the modules the allowed names live in, to show that nothing outside the pairs
resolves."""

from __future__ import annotations

import copyreg
import importlib
import io
import pickle
import types
from pathlib import Path

import pytest
import torch

from nanopt.errors import CheckpointError
from nanopt.train.checkpoint import shard_index, sharded

ALLOWED_MODULES = sorted({module for module, _ in shard_index.INDEX_GLOBALS})


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def global_payload(module: str, name: str, command: str) -> bytes:
    """Protocol 0's GLOBAL opcode: `c<module>\\n<name>\\n`, then call it with (command,)."""
    return f"c{module}\n{name}\n(S'{command}'\ntR.".encode()


def stack_global_payload(module: str, name: str, command: str) -> bytes:
    """Protocol 4's STACK_GLOBAL: the module and the (dotted) name as strings on the stack."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(command) + b"\x85R."


@pytest.fixture(scope="module")
def real_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real DCP checkpoint of a model and an optimizer state, written in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("dcp")
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(3.0)}}}}
    with pytest.warns(UserWarning):  # DCP says it runs without a process group: that is the point here
        dcp.save(state, checkpoint_id=str(directory))
    return directory


def test_a_real_index_reads_and_every_global_it_names_is_an_exact_pair(real_index: Path):
    named = []

    class Recording(shard_index.RecordingUnpickler):
        def find_class(self, module, name):
            named.append((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO((real_index / sharded.METADATA_FILE).read_bytes())).load()
    index = shard_index.read_index(real_index)
    assert set(index.state_dict_metadata) >= {"model.w", "model.b", "optimizer.state.w.exp_avg"}
    assert named and all("." not in name for _, name in named)
    assert all(pair in shard_index.INDEX_GLOBALS or shard_index.is_dtype_name(*pair) for pair in named)


@pytest.mark.parametrize("payload", [global_payload, stack_global_payload])
@pytest.mark.parametrize("module", ALLOWED_MODULES)
def test_a_dotted_name_through_an_allowed_module_runs_nothing(payload, module: str, real_index: Path,
                                                               tmp_path: Path):
    """`torch.distributed.checkpoint.metadata` imports os: ("...metadata", "os.system") was os.system itself."""
    marker = tmp_path / "ran"
    step = tmp_path / "step-000001"
    step.mkdir()
    for path in real_index.iterdir():
        (step / path.name).write_bytes(path.read_bytes())
    (step / sharded.METADATA_FILE).write_bytes(payload(module, "os.system", f"touch {marker}"))
    with pytest.raises(CheckpointError, match="not a readable shard index"):
        sharded.read_model_state(step)
    assert not marker.exists()


def test_the_extension_registry_and_persistent_ids_resolve_nothing(tmp_path: Path):
    marker = tmp_path / "ran"
    code = 0x7FFFFF00  # a private code: registered for this test only, as a third-party library could have done
    copyreg.add_extension("os", "system", code)
    try:
        ext4 = b"\x80\x02\x84" + code.to_bytes(4, "little") + b"X" + len(f"touch {marker}").to_bytes(4, "little") \
            + f"touch {marker}".encode() + b"\x85R."
        with pytest.raises(pickle.UnpicklingError):
            shard_index.RecordingUnpickler(io.BytesIO(ext4)).load()
    finally:
        copyreg.remove_extension("os", "system", code)
    with pytest.raises(pickle.UnpicklingError):
        shard_index.RecordingUnpickler(io.BytesIO(b"\x80\x02X\x01\x00\x00\x00xQ.")).load()  # BINPERSID
    assert not marker.exists()


def _attribute_paths(root: object, depth: int) -> list[str]:
    """Every dotted path of attributes reachable from `root` in `depth` steps (names from dir(), modules included),
    the way a protocol-4 pickle's dotted name would walk them."""
    paths, frontier = [], [("", root)]
    for _ in range(depth):
        following = []
        for prefix, obj in frontier:
            for name in dir(obj):
                try:
                    value = getattr(obj, name)
                except Exception:
                    continue
                path = f"{prefix}{name}"
                paths.append(path)
                if not isinstance(value, (str, bytes, int, float, bool, type(None))):
                    following.append((f"{path}.", value))
        frontier = following
    return paths


@pytest.mark.parametrize("module", ALLOWED_MODULES)
def test_nothing_reachable_from_an_allowed_module_resolves_but_the_exact_pairs(module: str):
    depth = 1 if module == "torch" else 2  # torch's second level is every function of every submodule: 10^6 names
    unpickler = shard_index.RecordingUnpickler(io.BytesIO(b""))
    resolved = set()
    for path in _attribute_paths(importlib.import_module(module), depth):
        try:
            unpickler.find_class(module, path)
        except pickle.UnpicklingError:
            continue
        resolved.add(path)
    exact = {name for m, name in shard_index.INDEX_GLOBALS if m == module}
    dtypes = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)} if module == "torch" \
        else set()
    assert resolved <= exact | dtypes
    assert not {path for path in resolved if "." in path}
    if module == "torch":  # the dotted walk below torch: through every submodule the index could name
        for sub in [v for v in vars(torch).values() if isinstance(v, types.ModuleType)]:
            for name in dir(sub):
                with pytest.raises(pickle.UnpicklingError):
                    unpickler.find_class("torch", f"{sub.__name__.split('.')[-1]}.{name}")
