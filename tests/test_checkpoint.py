"""Checkpoint files: atomic write, retention, checksum verification, fallback to the previous checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from trainhelp import write_tiny_checkpoint

from nanopt.errors import CheckpointError
from nanopt.train import checkpoint as ckpt


def write(run: Path, step: int) -> Path:
    return write_tiny_checkpoint(run, step)


def test_write_then_resolve_roundtrip(tmp_path: Path):
    write(tmp_path, 10)
    found = ckpt.resolve(tmp_path, "latest")
    assert found.step == 10 and found.meta["tokens"] == 100
    assert torch.equal(ckpt.load_model_state(found)["layers.0.attn.q_proj.weight"], torch.full((8, 8), 10.0))
    optim = ckpt.load_optimizer_state(found)
    assert optim["state"]["embed_tokens.weight"]["step"].item() == 10.0
    assert "embed_tokens.weight" in optim["param_groups"][0]["params"]
    assert ckpt.read_pointer(ckpt.checkpoints_dir(tmp_path), "latest") == "step-000010"


def test_retention_keeps_newest_and_best(tmp_path: Path):
    for step in (10, 20, 30, 40):
        write(tmp_path, step)
    ckpt.write_pointer(ckpt.checkpoints_dir(tmp_path), "best", "step-000010")
    ckpt.apply_retention(tmp_path, keep=2)
    names = [p.name for p in ckpt.complete_checkpoints(tmp_path)]
    assert names == ["step-000010", "step-000030", "step-000040"]


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "no_meta"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path: Path, damage: str):
    write(tmp_path, 10)
    newest = write(tmp_path, 20)
    weights = newest / "model.safetensors"
    if damage == "truncate":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "bitflip":
        data = bytearray(weights.read_bytes())
        data[-100] ^= 0x01
        weights.write_bytes(bytes(data))
    else:
        (newest / "meta.json").unlink()
    with pytest.raises(CheckpointError):
        ckpt.verify(newest)
    found, skipped = ckpt.newest_valid(tmp_path)
    assert found.step == 10
    assert len(skipped) == 1  # and the caller can say why the newest one was not used


FULL_DISK_SCRIPT = """
import resource, signal, sys, torch
from pathlib import Path
from nanopt.train import checkpoint as ckpt
from nanopt.errors import CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
big = {"w": torch.zeros(256, 256)}  # 256 KiB: over the limit, like a full disk mid-write
optim = {"state": {}, "param_groups": []}
try:
    ckpt.write_checkpoint(Path(sys.argv[1]), 20, big, optim, {"tokens": 200})
except CheckpointError as exc:
    print("ERROR", exc.one_line())
"""


def test_full_disk_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path: Path):
    import subprocess
    import sys

    write(tmp_path, 10)
    result = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert "ERROR could not write checkpoint" in result.stdout, result.stderr
    assert "earlier checkpoints" in result.stdout
    assert ckpt.resolve(tmp_path, "latest").step == 10
    assert ckpt.read_pointer(ckpt.checkpoints_dir(tmp_path), "latest") == "step-000010"
    assert not list(ckpt.checkpoints_dir(tmp_path).glob(".tmp-*"))  # nothing half-written left behind


def test_unknown_checkpoint_name_is_an_error(tmp_path: Path):
    write(tmp_path, 10)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.resolve(tmp_path, "step-999999")


def test_tied_weights_stored_once():
    from nanopt.train.parallel.wrap import tied_aliases

    model = torch.nn.Module()
    model.embed_tokens, model.x = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 3)
    model.lm_head = torch.nn.Linear(4, 8, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    assert tied_aliases(model) == {"lm_head.weight": "embed_tokens.weight"}
