"""Self-contained runs: a checkpoint carries its tokenizer, so export and sampling need no dataset and
eval checks any dataset against it; generation says why it stopped and refuses a prompt that fills the context;
what nanopt writes gets 0644 / 0755 less the umask; `best` only names an evaluated checkpoint.

One tiny run is trained in this process (so the umask a test sets is the one training runs under), then its
dataset is moved away, as a user who tidied their disk would have it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import TINY_MODEL, tiny_run

from nanopt.parsing import save_json

CONTEXT = TINY_MODEL["max_position_embeddings"]  # 16
STEP = "step-000004"


class Umask:
    """Set the process umask for a block and restore it after, whatever happens inside."""

    def __init__(self, mask: int) -> None:
        self.mask = mask

    def __enter__(self) -> None:
        self.previous = os.umask(self.mask)

    def __exit__(self, *exc: object) -> None:
        os.umask(self.previous)


def train_in_process(run: Path, *args: str) -> None:
    from nanopt.cli import main

    try:
        main(["train", str(run), "--no-live", *args])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> dict[str, Path]:
    """`run` trained 4 steps (one checkpoint, step-000004) under umask 022 on a dataset since moved to `moved`."""
    root = tmp_path_factory.mktemp("self-contained")
    data = Path(shutil.copytree(tiny_dataset, root / "data"))
    run = tiny_run(root, data, "run", max_steps=4, checkpoint_interval=4, eval_interval=0)
    with Umask(0o022):
        train_in_process(run)
    moved = data.rename(root / "moved")
    return {"root": root, "run": run, "moved": moved}


@pytest.fixture
def umask_022() -> Iterator[None]:
    with Umask(0o022):
        yield


def tokens_of(world: dict[str, Path], text: str) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(world["moved"] / "tokenizer.json")).encode(text, add_special_tokens=False))


def prompt_of(world: dict[str, Path], tokens: int) -> str:
    """A prompt of exactly `tokens` tokens of the run's tokenizer."""
    words = []
    while tokens_of(world, " ".join(words)) < tokens:
        words.append("the model reads")
    text = " ".join(words)
    while tokens_of(world, text) > tokens:
        text = text[:-1]
    assert tokens_of(world, text) == tokens
    return text


# -------------------------------------------------------------------------------- (3) the checkpoint's tokenizer


def test_a_checkpoint_carries_its_tokenizer_and_eos_id(world: dict[str, Path]):
    checkpoint = world["run"] / "checkpoints" / STEP
    dataset_meta = json.loads((world["moved"] / "meta.json").read_text())
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert (checkpoint / "tokenizer.json").read_bytes() == (world["moved"] / "tokenizer.json").read_bytes()
    assert meta["eos_id"] == dataset_meta["eos_id"]
    assert meta["files"]["tokenizer.json"] == meta["tokenizer_sha256"] == dataset_meta["tokenizer"]["sha256"]


def test_a_checkpoint_never_carries_another_tokenizer_than_it_trained_with(world: dict[str, Path], tmp_path: Path):
    """A dataset re-made at the same path while its run trains: the new tokenizer.json is not the one the run's
    meta.json names, so the checkpoint goes without one (eval and export then need --data) rather than lie."""
    from safetensors.torch import load_file

    from nanopt.train import checkpoint as ckpt

    trained = ckpt.verify(world["run"] / "checkpoints" / STEP)
    meta = {k: v for k, v in trained.meta.items() if k not in ("format_version", "step", "files",
                                                                 "optimizer_param_groups")}
    weights, optimizer = load_file(trained.path / "model.safetensors"), ckpt.load_optimizer_state(trained)
    remade = tmp_path / "tokenizer.json"
    remade.write_text((world["moved"] / "tokenizer.json").read_text().replace("<|endoftext|>", "<|end|>", 1))
    without = ckpt.write_checkpoint(tmp_path / "run", 5, weights, optimizer, meta, tokenizer=remade)
    assert not (without / "tokenizer.json").exists() and ckpt.verify(without).tokenizer_path is None
    carried = ckpt.write_checkpoint(tmp_path / "run", 6, weights, optimizer, meta,
                                    tokenizer=world["moved"] / "tokenizer.json")
    assert ckpt.verify(carried).tokenizer_path == carried / "tokenizer.json"


def test_export_and_samples_need_no_dataset(world: dict[str, Path], tmp_path: Path, cli_in_process):
    out = tmp_path / "hf"
    exported = cli_in_process("export", world["run"], "--out", out)
    assert exported.returncode == 0, exported.stderr
    assert (out / "tokenizer.json").read_bytes() == (world["moved"] / "tokenizer.json").read_bytes()
    eos = json.loads((world["moved"] / "meta.json").read_text())["eos_id"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos

    sampled = cli_in_process("eval", world["run"], "--no-loss", "--max-new-tokens", "4", "--json")
    assert sampled.returncode == 0, sampled.stderr
    result = json.loads(sampled.stdout)
    assert result["test_loss"] is None and result["dataset"] is None and result["step"] == 4
    assert [s["prompt"] for s in result["samples"]] == ["", "def", "The"]
    assert all(1 <= s["new_tokens"] <= 4 for s in result["samples"])
    assert not (world["run"] / "eval.json").exists()  # nothing measured, nothing to compare later


def test_eval_without_a_dataset_says_the_loss_needs_one(world: dict[str, Path], cli_in_process):
    result = cli_in_process("eval", world["run"])
    assert_user_error(result, "test loss needs a dataset", str(world["root"] / "data"), "--data DIR", "--no-loss")
    assert_user_error(cli_in_process("eval", world["run"], "--no-loss", "--no-samples"), "nothing to evaluate")


def test_eval_on_another_dataset_checks_it_against_the_checkpoints_tokenizer(world: dict[str, Path], tmp_path: Path,
                                                                              cli_in_process):
    run = Path(shutil.copytree(world["run"], tmp_path / "run"))  # eval.json is written into the run
    result = cli_in_process("eval", run, "--data", world["moved"], "--tokens", "256", "--max-new-tokens", "2",
                            "--json")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(result.stdout)
    assert evaluated["dataset"] == str(world["moved"]) and evaluated["test_loss"] > 0
    assert "recorded in step-000004" in evaluated["tokenizer_check"]


def test_data_given_as_the_tokenizer_file_names_the_directory_to_pass(world: dict[str, Path], tmp_path: Path,
                                                                      cli_in_process):
    tokenizer = world["moved"] / "tokenizer.json"
    for command in (["export", world["run"], "--out", tmp_path / "hf"], ["eval", world["run"], "--no-samples"]):
        result = cli_in_process(*command, "--data", tokenizer)
        assert_user_error(result, f"{tokenizer}: is a file", f"pass the dataset directory that holds it: --data "
                                                               f"{world['moved']}")
    assert not (tmp_path / "hf").exists()


def test_a_changed_tokenizer_in_the_checkpoint_is_refused(world: dict[str, Path], tmp_path: Path, cli_in_process):
    run = Path(shutil.copytree(world["run"], tmp_path / "run"))
    (run / "checkpoints" / STEP / "tokenizer.json").write_text("{}")
    result = cli_in_process("export", run, "--out", tmp_path / "hf")
    assert_user_error(result, "tokenizer.json: checksum mismatch")


def older_checkpoint(world: dict[str, Path], root: Path) -> Path:
    """A copy of the run as nanopt wrote checkpoints before they carried the tokenizer."""
    run = Path(shutil.copytree(world["run"], root / "older"))
    checkpoint = run / "checkpoints" / STEP
    meta = json.loads((checkpoint / "meta.json").read_text())
    del meta["files"]["tokenizer.json"], meta["eos_id"]
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    (checkpoint / "tokenizer.json").unlink()
    return run


def test_an_older_checkpoint_takes_its_tokenizer_from_a_dataset(world: dict[str, Path], tmp_path: Path,
                                                                cli_in_process):
    run = older_checkpoint(world, tmp_path)
    assert_user_error(cli_in_process("export", run, "--out", tmp_path / "hf"), "carries no tokenizer",
                      str(world["root"] / "data"), "--data DIR")
    exported = cli_in_process("export", run, "--out", tmp_path / "hf", "--data", world["moved"])
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (world["moved"] / "tokenizer.json").read_bytes()
    sampled = cli_in_process("eval", run, "--data", world["moved"], "--no-loss", "--max-new-tokens", "2", "--json")
    assert sampled.returncode == 0, sampled.stderr
    assert len(json.loads(sampled.stdout)["samples"]) == 3


# ---------------------------------------------------------------------------------------- (6) generation limits


def test_a_prompt_that_fills_the_context_is_refused_before_any_work(world: dict[str, Path], cli_in_process):
    fills = prompt_of(world, CONTEXT - 1)  # with the leading EOS: all 16 positions, no room for a new token
    result = cli_in_process("eval", world["run"], "--data", world["moved"], "--prompt", "The", "--prompt", fills)
    assert_user_error(result, f"{CONTEXT - 1} tokens", f"{CONTEXT} positions", "max_position_embeddings")
    assert not (world["run"] / "eval.json").exists()
    assert not (world["run"] / "checkpoints" / STEP / "eval.json").exists()


STOP_SHOWN = {"eos": "[EOS]", "max_new_tokens": "--max-new-tokens", "context_limit": "context limit"}


def test_each_sample_says_why_it_stopped(world: dict[str, Path], cli_in_process):
    nearly_full = prompt_of(world, CONTEXT - 3)  # with the leading EOS: room for 2 new tokens
    for max_new_tokens, reasons in (("1", {"max_new_tokens", "eos"}), ("32", {"context_limit", "eos"})):
        args = ("eval", world["run"], "--no-loss", "--prompt", nearly_full, "--max-new-tokens", max_new_tokens,
                "--temperature", "0")
        by_json = cli_in_process(*args, "--json")
        assert by_json.returncode == 0, by_json.stderr
        [sample] = json.loads(by_json.stdout)["samples"]
        assert sample["prompt_tokens"] == CONTEXT - 3 and sample["stopped"] in reasons, sample
        assert sample["new_tokens"] == (1 if max_new_tokens == "1" or sample["stopped"] == "eos" else 2)
        shown = cli_in_process(*args)
        assert shown.returncode == 0, shown.stderr
        assert STOP_SHOWN[sample["stopped"]] in shown.stdout
        assert f"{sample['new_tokens']} new token" in shown.stdout


def test_stop_reason_follows_the_generation_rule():
    import torch

    from nanopt.config import ModelConfig
    from nanopt.model.generate import generate, stop_reason
    from nanopt.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(architecture="llama", vocab_size=64, **TINY_MODEL))
    prompt = list(range(1, CONTEXT - 2))  # 13 tokens: room for 3
    limited = generate(model, prompt, 10, temperature=0.0)
    assert len(limited) == 3 and stop_reason(limited, 10, eos_id=None) == "context_limit"
    asked = generate(model, prompt, 2, temperature=0.0)
    assert asked == limited[:2] and stop_reason(asked, 2, eos_id=None) == "max_new_tokens"
    ended = generate(model, prompt, 10, temperature=0.0, eos_id=limited[0])
    assert ended == limited[:1] and stop_reason(ended, 10, eos_id=limited[0]) == "eos"


# -------------------------------------------------------------------------------------------- (9) permissions


def test_checkpoints_exports_and_results_get_the_permissions_of_a_plain_open(world: dict[str, Path], tmp_path: Path,
                                                                           cli_in_process, umask_022):
    out = tmp_path / "hf"
    for again in ([], ["--force"]):  # a new export, then one replacing it
        exported = cli_in_process("export", world["run"], "--out", out, "--data", world["moved"], *again)
        assert exported.returncode == 0, exported.stderr
    run = Path(shutil.copytree(world["run"], tmp_path / "run"))
    evaluated = cli_in_process("eval", run, "--data", world["moved"], "--tokens", "256", "--no-samples")
    assert evaluated.returncode == 0, evaluated.stderr
    trained = [p for p in world["run"].rglob("*") if p.name not in ("model.json", "train.json")]  # not nanopt's
    written = [*trained, out, *out.rglob("*"), run / "eval.json", run / "checkpoints" / STEP / "eval.json"]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {
        str(p): oct(0o755 if p.is_dir() else 0o644) for p in written}


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_a_rewritten_json_file_gets_a_new_files_mode_without_group_or_world_write(tmp_path: Path, mask: int):
    """A rewritten file used to keep its own mode, so a world-writable train.json that was
    downloaded stayed world-writable (and it holds `on_exit`, a shell command). Now it gets 0644 less the umask, as
    a new file does: group and world never get write, whatever the umask or the old mode."""
    shared = tmp_path / "train.json"  # as `nanopt find-batch --write` rewrites a run's train.json
    shared.write_text("{}")
    shared.chmod(0o666)
    with Umask(mask):
        save_json(shared, {"micro_batch_size": 8})
        fresh = tmp_path / "new.json"
        save_json(fresh, {})
    assert json.loads(shared.read_text())["micro_batch_size"] == 8
    assert stat.S_IMODE(shared.stat().st_mode) == stat.S_IMODE(fresh.stat().st_mode) == 0o644 & ~mask


# ------------------------------------------------------------------------------------------------- (5c) best


def test_best_names_only_an_evaluated_checkpoint(tiny_dataset: Path, tmp_path: Path):
    """Resumed with in-loop evaluation off, the run's last step is not evaluated: its checkpoint is not `best`,
    although the validation loss the run carries (from step 2) is still its best."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, eval_interval=2, checkpoint_interval=2)
    train_in_process(run)
    assert (run / "checkpoints" / "best").read_text().strip() == "step-000002"
    train_in_process(run, "--set", "max_steps=3", "--set", "eval_interval=0", "--allow-changed")
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    evaluated = {json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "eval"}
    assert evaluated == {2}
    assert (run / "checkpoints" / "best").read_text().strip() == "step-000002"
