"""The one safetensors header reader (nanopt.safetensors_header), on real files safetensors wrote and crafted or
damaged copies of them: whatever it accepts, safetensors' own loader loads with the same dtypes and shapes, and the
tensors' bytes tile the file; whatever it refuses is the caller's error class, one line naming the file.

The callers' end-to-end cases (`nanopt import`, `nanopt eval` of a checkpoint) are in tests/test_import.py and
tests/test_checkpoint_trust.py. NANOPT_FUZZ_EXAMPLES asks for more examples (derandomized either way).
"""

from __future__ import annotations

import copy
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from safetensorshelp import rewrite

from nanopt.errors import CheckpointError, DataError
from nanopt.safetensors_header import DTYPES, read_header

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "40"))
VALUES = [None, True, -1, 0, 1, 7, 2**40, 2**64, 1.5, "", "F32", "U16", "BOOL", [], [0], [0, 1], [1, 0], [3, 2],
          [2**63, 2**63 + 8], {}, {"a": "b"}, {"a": 1}]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file as safetensors writes one: several dtypes (integers and bool too), a zero-element tensor, metadata."""
    path = tmp_path_factory.mktemp("st") / "good.safetensors"
    save_file({"w": torch.randn(3, 5), "h": torch.randn(4, dtype=torch.float64).to(torch.bfloat16),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "mask": torch.ones(5, dtype=torch.bool),
               "empty": torch.zeros(0, 4)}, str(path), metadata={"format": "pt"})
    return path


def test_a_file_safetensors_wrote_reads_as_it_loads(good: Path):
    tensors = read_header(good, CheckpointError, "hint")
    assert {name: (t.torch_dtype, t.shape) for name, t in tensors.items()} == {
        "w": ("float32", (3, 5)), "h": ("bfloat16", (4,)), "ids": ("int64", (2, 3)), "mask": ("bool", (5,)),
        "empty": ("float32", (0, 4))}
    assert_loads_alike(good, tensors)


def assert_loads_alike(path: Path, tensors: dict) -> None:
    """safetensors' loader sees the same tensors, and their bytes tile the file from the header's end."""
    with safe_open(str(path), framework="pt") as opened:
        assert sorted(opened.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            loaded = opened.get_tensor(name)
            assert (str(loaded.dtype).removeprefix("torch."), tuple(loaded.shape)) == (tensor.torch_dtype,
                                                                                       tensor.shape)
    spans = sorted((t.start, t.end) for t in tensors.values())
    base = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert [base] + [end for _, end in spans] == [start for start, _ in spans] + [path.stat().st_size]


@pytest.mark.parametrize(("length", "fragment"), [(2**63, "a header of 9223372036854775808 bytes"),
                                                  (0, "a header of 0 bytes"),
                                                  (100_000_001, "a header of 100000001 bytes")])
def test_a_header_length_past_the_file_or_the_cap_is_refused_before_it_is_read(good: Path, tmp_path: Path,
                                                                               length: int, fragment: str):
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(struct.pack("<Q", length) + good.read_bytes()[8:])
    with pytest.raises(DataError, match=fragment) as refused:
        read_header(crafted, DataError, "use another dataset")
    assert str(crafted) in refused.value.message and refused.value.hint == "use another dataset"


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda h: h["w"].update(data_offsets=h["w"]["data_offsets"][::-1]), "has offsets"),
    (lambda h: h["w"].update(dtype="F8_E4M3"), "has dtype 'F8_E4M3', which nanopt does not read"),
    (lambda h: h["w"].update(shape=[5, 3.0]), "has shape [5, 3.0]"),
    (lambda h: h.update(__metadata__=["format", "pt"]), "__metadata__ is ['format', 'pt'], not a map of strings"),
])
def test_each_check_names_the_file_and_the_problem(good: Path, tmp_path: Path, edit, fragment: str):
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(good.read_bytes())
    rewrite(crafted, lambda header, data: edit(header))
    with pytest.raises(CheckpointError, match=str(crafted)) as refused:
        read_header(crafted, CheckpointError, "hint")
    assert fragment in refused.value.message


def _edit_at(header: dict, name_pick: int, field_pick: int, value: object) -> None:
    value = copy.deepcopy(value)  # VALUES' lists and maps are shared between examples
    names = sorted(header)
    name = names[name_pick % len(names)]
    if name == "__metadata__" or field_pick == 3 or not isinstance(header[name], dict):
        header[name] = value
    else:
        header[name][("dtype", "shape", "data_offsets")[field_pick]] = value


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(edits=[], cut=-8, flip=None)  # bytes no tensor owns after the last one
@example(edits=[], cut=4, flip=None)  # truncated
@example(edits=[(5, 2, [0, 60])], cut=0, flip=None)  # "w" (60 bytes) moved onto "ids"' bytes
@given(edits=st.lists(st.tuples(st.integers(0, 10), st.integers(0, 3), st.sampled_from(VALUES)), max_size=3),
       cut=st.integers(-8, 64), flip=st.one_of(st.none(), st.integers(0, 400)))
def test_a_crafted_or_damaged_header_is_refused_in_one_line_or_loads_alike(good: Path, tmp_path: Path, edits,
                                                                           cut: int, flip: int | None):
    """`edits` replace a tensor's dtype, shape or offsets, or a whole entry; `cut` bytes go from the end (a negative
    cut adds bytes); `flip` changes one byte."""
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(good.read_bytes())
    rewrite(crafted, lambda header, data: [_edit_at(header, *edit) for edit in edits])
    raw = crafted.read_bytes()
    raw = bytearray(raw[:len(raw) - cut] if cut >= 0 else raw + bytes(-cut))
    if flip is not None and flip < len(raw):
        raw[flip] ^= 0x5A
    crafted.write_bytes(bytes(raw))
    try:
        tensors = read_header(crafted, CheckpointError, "hint")
    except CheckpointError as exc:
        assert exc.message.startswith(f"{crafted}: ") and "\n" not in exc.message
        return
    assert all(t.dtype in DTYPES for t in tensors.values())
    assert_loads_alike(crafted, tensors)


def test_json_order_need_not_be_data_order(good: Path, tmp_path: Path):
    """safetensors writes names sorted and data by alignment: the reader follows the offsets, not the JSON."""
    def reverse(header: dict, data: bytearray) -> None:
        items = list(header.items())
        header.clear()
        header.update(reversed(items))

    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(good.read_bytes())
    rewrite(crafted, reverse)
    tensors = read_header(crafted, CheckpointError, "hint")
    assert list(tensors) == list(reversed(read_header(good, CheckpointError, "hint")))
    assert_loads_alike(crafted, tensors)
