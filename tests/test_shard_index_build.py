"""A shard index (DCP's `.metadata`, a pickle) may name only the index's own classes, and naming them must not let it
change them: BUILD with a slot state calls setattr on whatever is on the stack, a class included. nanopt's reader
resolves every global to a stand-in made for that one read, then builds the real index itself from checked fields.

These tests aim BUILD at every global an index may name (and at objects made from them), in both of its state
forms, with and without the real index behind the payload, and compare each real class's attributes before and
after; then they send the payload of the attack report through `nanopt train`, `eval` and `export` on a real
two-rank run and check the victim file is untouched."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import pickle
import struct
import warnings
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from faulthelp import TINY_MODEL, Launcher
from trainhelp import make_run

from nanopt.errors import CheckpointError
from nanopt.train import checkpoint as ckpt
from nanopt.train.checkpoint import shard_index

DTYPES = [("torch", "float32"), ("torch", "bfloat16"), ("torch", "int64")]
GLOBALS = sorted(shard_index.INDEX_GLOBALS) + DTYPES


def _text(value: str) -> bytes:
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()  # GLOBAL


def _slot_state(attrs: dict[str, str]) -> bytes:
    """(None, {attr: value}) on the stack: BUILD then calls setattr(target, attr, value) for each."""
    return b"N}" + b"".join(_text(k) + _text(v) + b"s" for k, v in attrs.items()) + b"\x86"


def _dict_state(attrs: dict[str, str]) -> bytes:
    """{attr: value}: BUILD then updates the target's __dict__ (a class's is a read-only proxy)."""
    return b"}" + b"".join(_text(k) + _text(v) + b"s" for k, v in attrs.items())


def _snapshot(obj: object) -> dict[str, object]:
    """Every attribute of `obj`: by identity from vars() for a class or module; for a value with no __dict__ (a
    dtype), every attribute that is data, by its repr (its methods are new objects on every lookup)."""
    if hasattr(obj, "__dict__"):
        return {name: id(value) for name, value in vars(obj).items()}
    return {name: repr(getattr(obj, name, None)) for name in dir(obj) if not callable(getattr(obj, name, None))}


def _real(module: str, name: str) -> object:
    return getattr(importlib.import_module(module), name)


def _everything() -> dict[tuple[str, str], dict[str, object]]:
    """The attributes of every global an index may name, and of the modules that hold them."""
    seen = {pair: _snapshot(_real(*pair)) for pair in GLOBALS}
    seen.update({(module, ""): _snapshot(importlib.import_module(module)) for module, _ in GLOBALS})
    return seen


@pytest.fixture(scope="module")
def real_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real DCP checkpoint of a model and an optimizer state, written in this process (no process group)."""
    import torch.distributed.checkpoint as dcp

    directory = tmp_path_factory.mktemp("dcp")
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optimizer": {"state": {"w": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(3.0)}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP says it runs without a process group: that is the point here
        dcp.save(state, checkpoint_id=str(directory))
    return directory


def _body(directory: Path) -> bytes:
    """The real index re-pickled at protocol 2 without its PROTO opcode, to follow a payload."""
    return pickle.dumps(pickle.loads((directory / shard_index.METADATA_FILE).read_bytes()), protocol=2)[2:]


def _read(directory: Path, payload: bytes, tmp_path: Path) -> Exception | object:
    step = tmp_path / "step"
    step.mkdir(exist_ok=True)
    (step / shard_index.METADATA_FILE).write_bytes(payload)
    try:
        return shard_index.read_index(step)
    except CheckpointError as exc:
        return exc


@pytest.mark.parametrize("state", [_slot_state, _dict_state], ids=["slot-state", "dict-state"])
@pytest.mark.parametrize("module,name", GLOBALS)
def test_build_aimed_at_an_allowed_global_changes_nothing_and_is_refused(module: str, name: str, state,
                                                                         real_index: Path, tmp_path: Path):
    victim = str(tmp_path / "victim.txt")
    attrs = {"_str": victim, "fqn": "x", "__doc__": "changed", "__reduce_ex__": "changed", "dtype": "changed"}
    before = _everything()
    payload = b"\x80\x02" + _global(module, name) + state(attrs) + b"b0" + _body(real_index)
    result = _read(real_index, payload, tmp_path)
    assert _everything() == before
    assert isinstance(result, CheckpointError) and "not a readable shard index" in str(result)
    assert f"it sets state on the class {module}.{name} itself" in str(result)
    assert str(pathlib.PosixPath("a", "b")) == "a/b"


@pytest.mark.parametrize("module,name", sorted(shard_index.INDEX_GLOBALS))
def test_build_on_an_object_made_from_an_allowed_global_reaches_only_that_object(module: str, name: str,
                                                                                 real_index: Path, tmp_path: Path):
    """NEWOBJ and REDUCE make stand-ins: BUILD on them records a state nobody reads; the real index behind it
    still reads, and no real class changed."""
    before = _everything()
    made = b"(" + _global(module, name) + b"o"  # INST-like OBJ: cls() with no arguments
    payload = b"\x80\x02" + made + _slot_state({"_str": "/tmp/x", "fqn": "y"}) + b"b0" + _body(real_index)
    index = _read(real_index, payload, tmp_path)
    assert _everything() == before
    assert not isinstance(index, Exception), index
    assert set(index.state_dict_metadata) >= {"model.w", "model.b", "optimizer.state.w.exp_avg"}


def test_a_real_index_is_rebuilt_field_for_field(real_index: Path):
    """What DCP itself would have unpickled, built by nanopt from the checked fields instead."""
    with open(real_index / shard_index.METADATA_FILE, "rb") as f:
        theirs = pickle.load(f)
    ours = shard_index.read_index(real_index)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data
    assert type(ours) is type(theirs)


def _tamper(directory: Path, edit) -> bytes:
    """The real index unpickled by pickle itself (a trusted file, written above), edited, and pickled again."""
    with open(directory / shard_index.METADATA_FILE, "rb") as f:
        index = pickle.load(f)
    edit(index)
    return pickle.dumps(index)


EDITS = {
    "a chunk past its tensor": lambda m: setattr(m.state_dict_metadata["model.w"].chunks[0], "sizes",
                                                 torch.Size([9, 4])),
    "a negative size": lambda m: setattr(m.state_dict_metadata["model.w"], "size", torch.Size([-3, 4])),
    "a shape of text": lambda m: setattr(m.state_dict_metadata["model.w"], "size", ("3", "4")),
    "a shard outside the checkpoint": lambda m: [setattr(info, "relative_path", "../../etc/passwd")
                                                 for info in m.storage_data.values()],
    "a dtype that is not one": lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", "float32"),
    "an entry that is a number": lambda m: m.state_dict_metadata.__setitem__("model.w", 5),
    "a negative offset": lambda m: [setattr(info, "offset", -1) for info in m.storage_data.values()],
    "a deeply nested key": lambda m: m.storage_data.__setitem__(
        next(iter(m.storage_data)), [[[[[[[[]]]]]]]] * 3),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_a_field_that_is_not_what_an_index_holds_is_one_line(edit: str, real_index: Path, tmp_path: Path):
    result = _read(real_index, _tamper(real_index, EDITS[edit]), tmp_path)
    assert isinstance(result, CheckpointError), edit
    assert "not a shard index nanopt can use" in str(result) and "\n" not in str(result)


def test_an_index_past_its_cap_is_refused_by_its_size_before_it_is_read(tmp_path: Path):
    step = tmp_path / "step"
    step.mkdir()
    with open(step / shard_index.METADATA_FILE, "wb") as f:
        f.truncate(shard_index.MAX_INDEX_BYTES + 1)  # sparse: no memory, no disk
    with pytest.raises(CheckpointError, match=r"more than the 16 MiB a shard index nanopt reads may hold"):
        shard_index.read_index(step)


# ------------------------------------------------------------------ the attack report's payload, end to end

TRAIN = {"micro_batch_size": 1, "global_batch_tokens": 32, "max_steps": 2, "checkpoint_interval": 1,
         "keep_checkpoints": 4, "eval_interval": 0, "warmup_steps": 1, "lr_schedule": "constant",
         "parallelism": "fsdp"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _plant(step: Path, victim: Path) -> None:
    """The report's payload: GLOBAL pathlib.PosixPath, BUILD (None, {"_str": victim}), POP, then the real index,
    with meta.json's checksum made to match, as a stranger handing over the run would."""
    body = pickle.dumps(pickle.loads((step / ".metadata").read_bytes()), protocol=2)
    build = _global("pathlib", "PosixPath") + _slot_state({"_str": os.path.abspath(victim)}) + b"b0"
    payload = b"\x80\x02" + build + body[2:]
    (step / ".metadata").write_bytes(payload)
    meta = json.loads((step / "meta.json").read_text())
    meta["files"][".metadata"] = hashlib.sha256(payload).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> dict:
    """A run trained on two gloo ranks (sharded checkpoints at steps 1 and 2), its step 2 index replaced by the
    payload, and a victim file beside it."""
    root = tmp_path_factory.mktemp("planted")
    run = make_run(root, tiny_dataset, "two-ranks", model=TINY_MODEL, **TRAIN)
    trained = launcher.train(run, "--nproc-per-node", "2")
    assert trained.returncode == 0, trained.stderr[-2000:]
    latest = ckpt.resolve(run, "latest")
    assert latest.step == 2 and latest.layout == ckpt.SHARDED
    victim = root / "victim.txt"
    victim.write_text("precious\n")
    _plant(latest.path, victim)
    return {"run": run, "victim": victim, "sha": _sha256(victim), "step": latest.path}


@pytest.mark.slow  # the two-rank run takes ~20 s; the tests above guard the reader itself in the default suite
@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_refuse_the_crafted_index_in_one_line(command: str, planted: dict, tmp_path: Path,
                                                              cli_in_process):
    before = _snapshot(pathlib.PosixPath)
    args = ["--checkpoint", planted["step"]] if command == "eval" else ["--checkpoint", planted["step"],
                                                                         "--out", tmp_path / "hf"]
    result = cli_in_process(command, planted["run"], *args)
    assert_user_error(result, str(planted["step"] / ".metadata"), "not a readable shard index")
    assert _snapshot(pathlib.PosixPath) == before  # the CLI ran in this process: its classes are these
    assert _sha256(planted["victim"]) == planted["sha"]
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_train_skips_the_crafted_checkpoint_and_the_victim_is_untouched(planted: dict, launcher: Launcher):
    resumed = launcher.train(planted["run"], "--nproc-per-node", "2", "--set", "max_steps=3", "--allow-changed")
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said[-3000:]
    assert "not a readable shard index" in said and "step-000001" in said, said[-3000:]
    assert _sha256(planted["victim"]) == planted["sha"]
    assert ckpt.resolve(planted["run"], "latest").step == 3
