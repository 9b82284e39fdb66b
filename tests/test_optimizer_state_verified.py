"""Every part of a checkpoint's optimizer state is held to its parameter: a part missing, of another shape or dtype,
or holding values no optimizer writes makes the checkpoint damaged. `nanopt train` skips it with a note naming the
parameter and the part, and resumes from the checkpoint before, exactly as if the damaged one had never been there.

Each case edits the optimizer state of a real run's newest checkpoint (steps 2 and 4 were saved) and seals it
again, meta.json's checksums updated, as a stranger handing over a checkpoint could: the checksums pass and only
the contents can tell. One process (safetensors) for AdamW, Muon and 8-bit AdamW's codes, scales and code book;
two FSDP ranks (DCP shards) for 8-bit AdamW too, where the index or one rank's shard is edited.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run
from safetensors.torch import load_file, save_file
from trainhelp import losses

NEWEST, PREVIOUS = "step-000004", "step-000002"
EMBED = "embed_tokens.weight"  # (512, 16): the tiny model's one tensor that 8-bit AdamW holds in 8 bits
Edit = Callable[[torch.Tensor], torch.Tensor] | None  # None: the part is removed


def train_tiny(root: Path, dataset: Path, launcher: Launcher, *args: str, **train: object) -> Path:
    run = tiny_run(root, dataset, "run", max_steps=4, checkpoint_interval=2, eval_interval=0, **train)
    launcher.train(run, *args)
    return run


def resumed_untouched(run: Path, root: Path, launcher: Launcher, *args: str) -> dict[int, float]:
    """The losses of `run` resumed from PREVIOUS, its checkpoints as written: what every skip must reproduce."""
    copy = Path(shutil.copytree(run, root / "untouched"))
    launcher.train(copy, "--resume", PREVIOUS, *args)
    return losses(copy)


def reseal(checkpoint: Path, name: str) -> None:
    """meta.json's checksum of the edited file made right again."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def damaged_copy(run: Path, tmp_path: Path, key: str, edit: Edit) -> Path:
    """A copy of the one-process run whose newest checkpoint's optimizer tensor `key` is edited (or removed)."""
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    checkpoint = copy / "checkpoints" / NEWEST
    path = checkpoint / "optimizer.safetensors"
    tensors = load_file(path)
    if edit is None:
        del tensors[key]
    else:
        tensors[key] = edit(tensors[key]).contiguous()
    save_file(tensors, path)
    reseal(checkpoint, path.name)
    return copy


def assert_skipped_for_previous(child, run: Path, fragment: str, untouched: dict[int, float]) -> None:
    notes = [line for line in child.stderr.splitlines() if "skipping a damaged checkpoint" in line]
    assert len(notes) == 1 and NEWEST in notes[0] and fragment in notes[0], child.stderr[-3000:]
    assert "Traceback" not in child.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumes = [r["checkpoint"] for r in records if r["kind"] == "event" and r.get("event") == "resume"]
    assert resumes == [PREVIOUS], resumes
    assert losses(run) == untouched


def nan_at(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.flatten().index_fill(0, torch.tensor([index]), float("nan")).reshape(t.shape)


# ------------------------------------------------------------------------- AdamW and Muon, one process


@pytest.fixture(scope="module")
def adamw(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> tuple[Path, dict]:
    run = train_tiny(tmp_path_factory.mktemp("adamw"), tiny_dataset, launcher)
    return run, resumed_untouched(run, tmp_path_factory.mktemp("adamw-untouched"), launcher)


Q = "layers.0.attn.q_proj.weight"  # (16, 16)
ADAMW_DAMAGES: dict[str, tuple[str, Edit, str]] = {
    "exp_avg_sq_removed": (f"{Q}/exp_avg_sq", None, f"'{Q}/exp_avg_sq' is missing"),
    "step_as_an_integer": ("norm.weight/step", lambda t: t.long(), "'norm.weight/step' is int64 (), adamw keeps "
                                                                     "float32 ()"),
    "step_past_the_checkpoint": ("norm.weight/step", lambda t: t + 1e6, "'norm.weight/step' is 1e+06, not a step "
                                                                         "count from 0 to the checkpoint's step 4"),
    "nan_in_exp_avg": (f"{EMBED}/exp_avg", nan_at(100), f"'{EMBED}/exp_avg' holds a non-finite value"),
    "negative_exp_avg_sq": ("norm.weight/exp_avg_sq", lambda t: -t - 1, "'norm.weight/exp_avg_sq' holds a negative "
                                                                          "value"),
}


@pytest.mark.parametrize("damage", list(ADAMW_DAMAGES))
def test_adamw_state_that_disagrees_with_its_parameter_is_skipped_for_the_previous_checkpoint(
        damage: str, adamw: tuple[Path, dict], tmp_path: Path, launcher: Launcher):
    key, edit, fragment = ADAMW_DAMAGES[damage]
    run = damaged_copy(adamw[0], tmp_path, key, edit)
    assert_skipped_for_previous(launcher.train(run), run, fragment, adamw[1])


def test_muon_momentum_removed_is_skipped_for_the_previous_checkpoint(tmp_path: Path, tiny_dataset: Path,
                                                                       launcher: Launcher):
    trained = train_tiny(tmp_path / "trained", tiny_dataset, launcher, optimizer="muon")
    untouched = resumed_untouched(trained, tmp_path, launcher)
    run = damaged_copy(trained, tmp_path, f"{Q}/momentum_buffer", None)
    assert_skipped_for_previous(launcher.train(run), run, f"'{Q}/momentum_buffer' is missing", untouched)


def test_damaged_values_with_no_checkpoint_before_them_are_one_line(adamw: tuple[Path, dict], tmp_path: Path,
                                                                    launcher: Launcher):
    run = damaged_copy(adamw[0], tmp_path, f"{EMBED}/exp_avg", nan_at(3))
    shutil.rmtree(run / "checkpoints" / PREVIOUS)
    assert_user_error(launcher.run("train", run, "--no-live"), "no usable checkpoint", NEWEST,
                      f"'{EMBED}/exp_avg' holds a non-finite value")


# ------------------------------------------------------------------------------- 8-bit AdamW, one process


@pytest.fixture(scope="module")
def eight_bit(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> tuple[Path, dict]:
    pytest.importorskip("torchao")
    run = train_tiny(tmp_path_factory.mktemp("adamw8bit"), tiny_dataset, launcher, optimizer="adamw8bit")
    return run, resumed_untouched(run, tmp_path_factory.mktemp("adamw8bit-untouched"), launcher)


EIGHT_BIT_DAMAGES: dict[str, tuple[str, Edit, str]] = {
    "scale_a_row_short": ("exp_avg_scale", lambda t: t[:-1], "'embed_tokens.weight/exp_avg_scale' is float32 (31, 1), "
                                                              "adamw8bit keeps float32 (32, 1)"),
    "scale_a_row_over": ("exp_avg_sq_scale", lambda t: torch.cat([t, t[:1]]), "_sq_scale' is float32 (33, 1)"),
    "scale_in_float64": ("exp_avg_scale", lambda t: t.double(), "_scale' is float64 (32, 1)"),
    "codes_of_another_shape": ("exp_avg_codes", lambda t: t.reshape(256, 32), "_codes' is uint8 (256, 32)"),
    "codes_of_another_dtype": ("exp_avg_sq_codes", lambda t: t.to(torch.int16), "_sq_codes' is int16 (512, 16)"),
    "qmap_cut_short": ("exp_avg_qmap", lambda t: t[:128], "_qmap' is float32 (128,), adamw8bit keeps float32 (256,)"),
    "codes_removed": ("exp_avg_codes", None, "'embed_tokens.weight/exp_avg_codes' is missing"),
    "nan_in_qmap": ("exp_avg_qmap", nan_at(7), "'embed_tokens.weight/exp_avg_qmap' holds a non-finite value"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(EIGHT_BIT_DAMAGES))
def test_adamw8bit_part_that_disagrees_with_its_parameter_is_skipped_for_the_previous_checkpoint(
        damage: str, eight_bit: tuple[Path, dict], tmp_path: Path, launcher: Launcher):
    part, edit, fragment = EIGHT_BIT_DAMAGES[damage]
    run = damaged_copy(eight_bit[0], tmp_path, f"{EMBED}/{part}", edit)
    assert_skipped_for_previous(launcher.train(run), run, fragment, eight_bit[1])


# ----------------------------------------------------------------------- 8-bit AdamW, two FSDP ranks (DCP)

TWO_RANKS = ("--nproc-per-node", "2")


@pytest.fixture(scope="module")
def fsdp_eight_bit(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    pytest.importorskip("torchao")
    return train_tiny(tmp_path_factory.mktemp("fsdp8"), tiny_dataset, launcher, *TWO_RANKS, optimizer="adamw8bit",
                      parallelism="fsdp")


def edit_index(checkpoint: Path, edit: Callable[[dict], object]) -> None:
    """`edit` applied to the shard index's table of entries (the test's own file: a plain unpickle is safe)."""
    path = checkpoint / ".metadata"
    index = pickle.loads(path.read_bytes())
    edit(index.state_dict_metadata)
    path.write_bytes(pickle.dumps(index))
    reseal(checkpoint, path.name)


def scale_with_a_row_over(entries: dict) -> None:
    key = f"optimizer.state.{EMBED}.exp_avg_scale"
    entries[key] = dataclasses.replace(entries[key], size=torch.Size([33, 1]))


def codes_removed(entries: dict) -> None:
    del entries[f"optimizer.state.{EMBED}.exp_avg_sq_codes"]


def nan_in_the_second_rank_shard(checkpoint: Path) -> None:
    """A NaN among the scales of rows only the second rank holds: only that rank sees it as it loads."""
    from nanopt.train.checkpoint import sharded

    scale = torch.empty(32, 1)
    sharded.load({"optimizer": {"state": {EMBED: {"exp_avg_sq_scale": scale}}}}, checkpoint)
    shard = checkpoint / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    at = data.find(scale[16:].numpy().tobytes())  # rows 16-31: the second rank's half, stored by that rank
    assert at > 0 and data.find(scale[:16].numpy().tobytes()) < 0
    data[at + 4:at + 8] = struct.pack("<f", float("nan"))
    shard.write_bytes(bytes(data))
    reseal(checkpoint, shard.name)


SHARDED_DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "scale_a_row_over": (lambda c: edit_index(c, scale_with_a_row_over), "_scale' is float32 (33, 1)"),
    "codes_removed": (lambda c: edit_index(c, codes_removed), f"'{EMBED}/exp_avg_sq_codes' is missing"),
    "nan_in_one_rank_shard": (nan_in_the_second_rank_shard, f"'{EMBED}/exp_avg_sq_scale' holds a non-finite value"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(SHARDED_DAMAGES))
def test_adamw8bit_sharded_state_that_disagrees_is_skipped_on_every_rank(damage: str, fsdp_eight_bit: Path,
                                                                        tmp_path: Path, launcher: Launcher):
    """Two ranks resume what two ranks wrote: exact, so the losses are the uninterrupted run's."""
    spoil, fragment = SHARDED_DAMAGES[damage]
    run = Path(shutil.copytree(fsdp_eight_bit, tmp_path / "run"))
    spoil(run / "checkpoints" / NEWEST)
    assert_skipped_for_previous(launcher.train(run, *TWO_RANKS), run, fragment, losses(fsdp_eight_bit))
