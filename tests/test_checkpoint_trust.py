"""A checkpoint may come from someone else (docs/design.md, "The trust boundary"): its config snapshot, its resume
state and the size of the model it describes are checked before anything is allocated or restored.

Every case edits the meta.json of a real checkpoint that `nanopt train` wrote (a tiny run with checkpoints at steps
2 and 4, copied per test). `train` then skips the edited step-4 checkpoint with a note and resumes from step 2;
`eval` and `export` of that checkpoint by name refuse it in one line, exit 2, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from clihelp import REPO, assert_user_error
from faulthelp import Launcher, tiny_run, tree_digest
from safetensorshelp import append_tensor, rewrite
from trainhelp import HIDE_CUDA

NEWEST = "step-000004"
# What a CLI process that refuses early holds (~0.4 GB: python, torch, nanopt); the model a 270 KB checkpoint's
# snapshot can describe is far above it (`SNAPSHOTS`).
RSS_LIMIT = 1 << 30


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    run = tiny_run(tmp_path_factory.mktemp("trust"), tiny_dataset, "run", max_steps=4, checkpoint_interval=2,
                   eval_interval=0)
    launcher.train(run)
    return run


def crafted(trained: Path, tmp_path: Path, edit: Callable[[dict], object]) -> Path:
    """A copy of the trained run whose newest checkpoint's meta.json `edit` changed (in place)."""
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    meta_path = run / "checkpoints" / NEWEST / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    return run


def assert_falls_back(launcher: Launcher, run: Path, *fragments: str) -> None:
    # Two steps more than the run had, so the state restored is used: steps 3 to 6 from the checkpoint before.
    child = launcher.train(run, "--set", "max_steps=6", "--allow-changed")
    note = next(line for line in child.stderr.splitlines() if "skipping a damaged checkpoint" in line)
    assert NEWEST in note and all(f in note for f in fragments), note
    assert "resumed from" in child.stderr and "step-000002" in child.stderr and "Traceback" not in child.stderr


# ---------------------------------------------------------------------------------- the config snapshot


def zero_heads(meta: dict) -> None:
    meta["config"]["model"]["num_attention_heads"] = 0


def test_zero_heads_in_the_snapshot_is_one_line_not_a_division_by_zero(trained: Path, tmp_path: Path,
                                                                       cli_in_process, launcher: Launcher):
    run = crafted(trained, tmp_path, zero_heads)
    for command in (("eval", run, "--no-loss", "--checkpoint", NEWEST),
                    ("export", run, "--checkpoint", NEWEST, "--out", tmp_path / "hf")):
        assert_user_error(cli_in_process(*command), f"{NEWEST}/meta.json", "num_attention_heads", "must be positive")
    assert not (tmp_path / "hf").exists()
    assert_falls_back(launcher, run, "num_attention_heads")


def test_a_snapshot_validated_like_train_json(trained: Path, tmp_path: Path, cli_in_process):
    run = crafted(trained, tmp_path, lambda meta: meta["config"]["train"].update(micro_batch_size=-3))
    assert_user_error(cli_in_process("eval", run, "--no-loss", "--checkpoint", NEWEST), "config.train",
                      "micro_batch_size")


def test_weights_that_disagree_with_the_snapshot_are_one_line(trained: Path, tmp_path: Path, cli_in_process,
                                                              launcher: Launcher):
    run = crafted(trained, tmp_path, lambda meta: meta["config"]["model"].update(intermediate_size=48))
    for command in (("eval", run, "--no-loss", "--checkpoint", NEWEST),
                    ("export", run, "--checkpoint", NEWEST, "--out", tmp_path / "hf")):
        assert_user_error(cli_in_process(*command), "weights do not match its own model config",
                          "layers.0.mlp.down_proj.weight has shape (16, 32), the model's (16, 48)")
    assert_falls_back(launcher, run, "weights do not match")


# Optimizer state under a name AdamW does not use is left to the optimizer, which ignores it; its header is still
# read as a stranger's file, with the checks safetensors' own loader skips.
STATE_HEADERS = {
    "dtype_nanopt_does_not_read": (("U16", [2], 4), "has dtype 'U16', which nanopt does not read"),
    "dimension_past_2_40": (("F32", [2**41, 0], 0), "has shape [2199023255552, 0]"),
}


@pytest.mark.parametrize("damage", list(STATE_HEADERS))
def test_an_optimizer_header_safetensors_accepts_but_nanopt_does_not_read_is_one_line(trained: Path, tmp_path: Path,
                                                                                      damage: str, cli_in_process):
    (dtype, shape, size), fragment = STATE_HEADERS[damage]
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    checkpoint = run / "checkpoints" / NEWEST
    optimizer = checkpoint / "optimizer.safetensors"
    rewrite(optimizer, append_tensor("embed_tokens.weight/unknown_state", dtype, shape, size))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"]["optimizer.safetensors"] = hashlib.sha256(optimizer.read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    assert_user_error(cli_in_process("eval", run, "--no-loss", "--checkpoint", NEWEST), "optimizer.safetensors",
                      "tensor 'embed_tokens.weight/unknown_state'", fragment)


# `python -m nanopt ARGS` that writes its own peak resident memory (VmHWM) to the file named in argv[1] as it exits.
# Not ru_maxrss from wait4: Linux carries the parent's high-water mark into a child across fork and exec, so a child
# of a pytest worker that has grown past 1 GiB would report the worker's peak, not its own. VmHWM belongs to the
# memory map exec makes, so it counts the command alone.
PEAK_REPORTING = """
import atexit, runpy, sys
peak_file = sys.argv.pop(1)
def report():
    with open("/proc/self/status") as status, open(peak_file, "w") as out:
        out.write(next(line for line in status if line.startswith("VmHWM:")).split()[1])
atexit.register(report)
runpy.run_module("nanopt", run_name="__main__", alter_sys=True)
"""


def run_measured(*args: object) -> tuple[SimpleNamespace, int]:
    """`nanopt ARGS` in a child process, and that child's own peak resident memory in bytes."""
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **HIDE_CUDA}
    with tempfile.TemporaryDirectory() as scratch, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        peak_file = Path(scratch) / "peak"
        child = subprocess.run([sys.executable, "-c", PEAK_REPORTING, str(peak_file), *map(str, args)], cwd=REPO,
                               env=env, stdout=out, stderr=err, text=True, timeout=600)
        out.seek(0)
        err.seek(0)
        result = SimpleNamespace(returncode=child.returncode, stdout=out.read(), stderr=err.read())
        peak = int(peak_file.read_text()) * 1024  # VmHWM is in kB
    return result, peak


# A 1.6 GB model (411M parameters) and a 13-quadrillion-parameter one, each on the 270 KB of a 41K-parameter
# checkpoint: every dimension is within model.json's bounds.
SNAPSHOTS = {"1.6GB": {"hidden_size": 2048, "num_hidden_layers": 8},
             "52PB": {"hidden_size": 1 << 20, "num_hidden_layers": 1000}}


@pytest.mark.parametrize(("size", "command"), [("1.6GB", "eval"), ("52PB", "export")])
def test_a_snapshot_larger_than_its_files_is_refused_without_allocating(trained: Path, tmp_path: Path, size: str,
                                                                        command: str):
    def bigger(meta: dict) -> None:
        meta["config"]["model"].update(intermediate_size=None, num_attention_heads=8, num_key_value_heads=8,
                                       **SNAPSHOTS[size])

    run = crafted(trained, tmp_path, bigger)
    options = ("--no-loss",) if command == "eval" else ("--out", tmp_path / "hf")
    result, peak = run_measured(command, run, "--checkpoint", NEWEST, *options)
    assert_user_error(result, "weights do not match its own model config")
    assert peak < RSS_LIMIT, f"{command} reached {peak / 2**30:.2f} GiB of memory"


# ----------------------------------------------------------------------------------------- the resume state


def _rng(meta: dict) -> dict:
    return meta["ranks"][0]["rng"]


DAMAGES = {
    "rng_torch_a_number": (lambda meta: _rng(meta).update(torch=5), "ranks[0].rng 'torch'"),
    "rng_torch_too_short": (lambda meta: _rng(meta).update(torch=_rng(meta)["torch"][:400]), "refused by torch"),
    "rng_numpy_too_short": (lambda meta: _rng(meta)["numpy"].__setitem__(1, _rng(meta)["numpy"][1][:10]),
                            "ranks[0].rng 'numpy'"),
    "rng_numpy_position_outside": (lambda meta: _rng(meta)["numpy"].__setitem__(2, -5), "a position outside"),
    "rng_python_a_string": (lambda meta: _rng(meta).update(python="state"), "ranks[0].rng 'python'"),
    "recovery_negative": (lambda meta: meta["recovery"].update(recoveries=-1), "recovery.recoveries is -1"),
    "ramp_factor_zero": (lambda meta: meta["recovery"].update(lr_ramp_factor=0), "lr_ramp_factor"),
    "lr_nan": (lambda meta: meta["optimizer_param_groups"][0].update(lr=float("nan")),
               "optimizer_param_groups[0].lr is nan"),
    "betas_out_of_range": (lambda meta: meta["optimizer_param_groups"][1].update(betas=[0.9, 1.5]), "betas"),
    "maximize_on": (lambda meta: meta["optimizer_param_groups"][0].update(maximize=True), "maximize"),
    "an_extra_group": (lambda meta: meta["optimizer_param_groups"].append(meta["optimizer_param_groups"][1]),
                       "holds 3 groups, adamw has 2"),
    "groups_swapped": (lambda meta: meta["optimizer_param_groups"].reverse(), "optimizer_param_groups[0] lists"),
    "loader_step_negative": (lambda meta: meta["ranks"][0]["loader"].update(step=-1), "ranks[0].loader.step"),
    "two_ranks_for_one": (lambda meta: meta["ranks"].append(meta["ranks"][0]), "lists 2 rank(s)"),
    "tokens_past_int64": (lambda meta: meta.update(tokens=2**64), "'tokens'"),
    "eos_past_the_vocabulary": (lambda meta: meta.update(eos_id=512), "'eos_id' 512"),
    "tied_to_another_name": (lambda meta: meta.update(tied={"lm_head.weight": "norm.weight"}), "'tied'"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_resume_field_out_of_range_is_refused_by_eval_and_export(trained: Path, tmp_path: Path, cli_in_process,
                                                                   damage: str):
    edit, fragment = DAMAGES[damage]
    run = crafted(trained, tmp_path, edit)
    assert_user_error(cli_in_process("eval", run, "--no-loss", "--checkpoint", NEWEST), fragment,
                      "a damaged or foreign checkpoint")
    assert_user_error(cli_in_process("export", run, "--checkpoint", NEWEST, "--out", tmp_path / "hf"), fragment)


@pytest.mark.parametrize("damage", ["rng_torch_too_short", "rng_numpy_position_outside", "recovery_negative",
                                    "lr_nan", "an_extra_group", "loader_step_negative"])
def test_train_skips_a_checkpoint_with_a_resume_field_out_of_range(trained: Path, tmp_path: Path, damage: str,
                                                                   launcher: Launcher):
    edit, fragment = DAMAGES[damage]
    assert_falls_back(launcher, crafted(trained, tmp_path, edit), fragment)


def test_with_no_usable_checkpoint_train_refuses_rather_than_start_over(trained: Path, tmp_path: Path,
                                                                         launcher: Launcher):
    """Every checkpoint damaged: training from step 0 would truncate metrics.jsonl and write new checkpoints among
    the old ones; one line says what is wrong instead."""
    run = crafted(trained, tmp_path, lambda meta: meta.update(tokens="many"))
    older = run / "checkpoints" / "step-000002" / "meta.json"
    older.write_text(json.dumps({**json.loads(older.read_text()), "tokens": "many"}))
    before = tree_digest(run)
    child = launcher.run("train", run, "--no-live")
    assert_user_error(child, "no usable checkpoint", "--resume none")
    assert tree_digest(run) == before


# ------------------------------------------------------------------------------------- memory it cannot have


def test_train_refuses_a_model_json_larger_than_the_machine_with_the_estimate(tmp_path: Path, tiny_dataset: Path,
                                                                              launcher: Launcher):
    """Each model.json dimension is bounded; their product is checked against the machine too, before any tensor
    is allocated (before: a 4 TiB allocation traceback)."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=4)
    model = json.loads((run / "model.json").read_text())
    model.update(hidden_size=1 << 20, num_hidden_layers=1000, intermediate_size=None, num_attention_heads=8,
                 num_key_value_heads=8)
    (run / "model.json").write_text(json.dumps(model))
    before = tree_digest(run)
    child = launcher.run("train", run, "--no-live")
    assert_user_error(child, "model.json: the model's weights, gradients and AdamW state",
                      "13,194,410,603,839,488 parameters", "take at least", "GiB", "more than this machine's")
    assert tree_digest(run) == before


# ------------------------------------------------------------------------- meta.json that is not one nanopt wrote

UNPARSEABLE = {"nested_100000_deep": "[" * 100_000 + "]" * 100_000, "a_5000_digit_step": '{"step": ' + "9" * 5000 + "}",
               "not_utf8": b"\xff\xfe{}"}


@pytest.mark.parametrize("content", list(UNPARSEABLE))
def test_a_meta_json_no_parser_should_trust_is_one_line_and_train_falls_back(trained: Path, tmp_path: Path,
                                                                            content: str, launcher: Launcher):
    """Read as every file from a stranger is (bounded, no recursion): eval and export of that checkpoint are one
    line, train skips it with a note, and retention never takes it for a checkpoint of its step."""
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    data = UNPARSEABLE[content]
    (run / "checkpoints" / NEWEST / "meta.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    for command in (("eval", run, "--no-loss", "--checkpoint", NEWEST),
                    ("export", run, "--checkpoint", NEWEST, "--out", tmp_path / "hf")):
        child = launcher.run(*command)
        assert child.status == 2 and "Traceback" not in child.stderr, child.stderr[-2000:]
        assert f"{NEWEST}/meta.json" in child.stderr
    assert_falls_back(launcher, run)
