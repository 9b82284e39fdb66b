"""`nanopt eval` on a tiny trained run: the test loss against a direct computation, bits per byte, reproducible
samples, the comparison table, other datasets and their tokenizers, and the errors a user can cause.

Commands run in this process (`cli_in_process`) or, where another process matters, forked from the warm launcher
(tests/faulthelp.py); two ranks run the library's evaluation on two gloo ranks (tests/distributed.py).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from clihelp import assert_user_error
from distributed import run_ranks
from faulthelp import Launcher
from trainhelp import HIDE_CUDA, make_run

from nanopt.evaluate.compare import ranked, training_seconds


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> dict[str, Path]:
    """`strong`: trained 12 steps with checkpoints at 6 and 12. `weak`: the same run as if it had stopped at step 6
    (a copy without the step-12 checkpoint), so it has a higher test loss."""
    root = tmp_path_factory.mktemp("runs")
    strong = make_run(root, tiny_dataset, "strong", max_steps=12, eval_interval=0, checkpoint_interval=6)
    launcher.train(strong)
    weak = shutil.copytree(strong, root / "weak")
    shutil.rmtree(weak / "checkpoints" / "step-000012")
    return {"strong": strong, "weak": weak}


def eval_json(launcher: Launcher, *args: object) -> dict:
    """`nanopt eval ... --json` in a process of its own, as a user runs it."""
    result = launcher.run("eval", *args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def evaluate_in_rank(run: Path, checkpoint: str, tokens: int) -> dict:
    """What `nanopt eval RUN --checkpoint C --tokens N --no-samples` does in each torchrun worker."""
    from nanopt.evaluate.report import EvalOptions, evaluate_runs

    [result] = evaluate_runs([run], EvalOptions(checkpoint=checkpoint, tokens=tokens, samples=None))
    return result


@pytest.fixture
def cli(cli_in_process):
    return cli_in_process


def in_process_json(cli, *args: object) -> dict:
    result = cli("eval", *args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


# --------------------------------------------------------------------------------------------------- numbers


def direct_test_loss(run: Path, dataset: Path, step_dir: str, tokens: int) -> float:
    """Mean cross-entropy of the checkpoint over the first `tokens` targets of the test split, computed here from
    the shard files, the weights file and the model's logits; nothing from nanopt's evaluation code."""
    from safetensors.torch import load_file

    from nanopt.config import ModelConfig
    from nanopt.model.transformer import Transformer

    ckpt = run / "checkpoints" / step_dir
    meta = json.loads((ckpt / "meta.json").read_text())
    model = Transformer(ModelConfig(**meta["config"]["model"]))
    missing, unexpected = model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is stored once
    model.eval()
    data_meta = json.loads((dataset / "meta.json").read_text())
    stream = np.concatenate([np.load(dataset / s["file"]) for s in data_meta["splits"]["test"]["shards"]])
    seq_len = meta["config"]["model"]["max_position_embeddings"]
    starts = range(0, tokens, seq_len)
    inputs = torch.tensor(np.stack([stream[s:s + seq_len] for s in starts]).astype(np.int64))
    targets = torch.tensor(np.stack([stream[s + 1:s + seq_len + 1] for s in starts]).astype(np.int64))
    with torch.no_grad():
        logits = model(inputs).double()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def test_test_loss_matches_a_direct_computation_and_is_recorded(runs, tiny_dataset: Path, cli):
    run = runs["strong"]
    result = in_process_json(cli, run, "--tokens", "2048", "--no-samples")
    assert result["split"] == "test" and result["step"] == 12 and result["tokens"] == 2048
    assert abs(result["test_loss"] - direct_test_loss(run, tiny_dataset, "step-000012", 2048)) < 1e-5
    assert result["perplexity"] == pytest.approx(math.exp(result["test_loss"]), rel=1e-12)
    test_split = json.loads((tiny_dataset / "meta.json").read_text())["splits"]["test"]
    bytes_per_token = test_split["bytes"] / test_split["tokens"]
    assert result["bits_per_byte"] == pytest.approx(result["test_loss"] / math.log(2) / bytes_per_token, rel=1e-12)
    assert result["parameters"] > 0 and result["tokens_trained"] == 12 * 256 and result["global_batch_tokens"] == 256
    assert result["train_seconds"] > 0
    beside_checkpoint = json.loads((run / "checkpoints" / "step-000012" / "eval.json").read_text())
    assert beside_checkpoint == json.loads((run / "eval.json").read_text())
    assert beside_checkpoint.items() <= result.items()  # --json adds the cost columns of the comparison
    assert not list(run.glob("*.tmp")) and not list((run / "checkpoints" / "step-000012").glob("*.tmp"))


def test_an_older_checkpoint_and_two_ranks(runs, tiny_dataset: Path, cli):
    # 2048 tokens = 64 windows of 32: 2 ranks x 8 batches of 4 score the same tokens as 1 rank x 16 batches.
    run = runs["strong"]
    older = in_process_json(cli, run, "--checkpoint", "step-000006", "--tokens", "2048", "--no-samples")
    assert older["step"] == 6
    assert abs(older["test_loss"] - direct_test_loss(run, tiny_dataset, "step-000006", 2048)) < 1e-5
    two_ranks, rank1 = run_ranks(evaluate_in_rank, run, "step-000006", 2048, env=HIDE_CUDA)
    assert two_ranks["world_size"] == 2 and two_ranks["tokens"] == 2048
    assert two_ranks["test_loss"] == pytest.approx(older["test_loss"], abs=1e-6)
    assert rank1["test_loss"] == two_ranks["test_loss"]  # the loss is reduced over the ranks: both hold it
    assert json.loads((run / "eval.json").read_text())["step"] == 6  # the run's latest evaluation


def test_default_slice_is_the_whole_test_split_when_smaller(runs, tiny_dataset: Path, cli):
    split_tokens = json.loads((tiny_dataset / "meta.json").read_text())["splits"]["test"]["tokens"]
    assert split_tokens < 1_048_576
    result = in_process_json(cli, runs["weak"], "--no-samples")
    assert result["settings"]["max_tokens"] == 1_048_576
    assert result["tokens"] == split_tokens - 1 and result["split_tokens"] == split_tokens  # all but the first


# -------------------------------------------------------------------------------------------------- samples


def test_samples_are_reproducible_with_a_seed(runs, cli, launcher: Launcher):
    args = (runs["strong"], "--tokens", "128", "--prompt", "The model", "--prompt", "", "--max-new-tokens", "12",
            "--temperature", "1.0", "--seed", "5")
    first = eval_json(launcher, *args)["samples"]  # another process: nothing but the seed carries over
    assert [s["prompt"] for s in first] == ["The model", ""]
    assert all(0 < s["new_tokens"] <= 12 and s["completion"] for s in first)
    assert in_process_json(cli, *args)["samples"] == first
    assert in_process_json(cli, *args[:-1], "9")["samples"] != first


def test_samples_are_shown_in_panels(runs, cli):
    result = cli("eval", runs["strong"], "--tokens", "128", "--max-new-tokens", "8", "--seed", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test loss" in result.stdout and "bits per byte" in result.stdout
    for title in ("(a new document)", "'def'", "'The'"):
        assert title in result.stdout


# ----------------------------------------------------------------------------------------------- comparison


def test_comparison_is_sorted_by_test_loss_and_reuses_evaluations(runs, cli):
    strong, weak = str(runs["strong"]), str(runs["weak"])
    args = ("--tokens", "1024", "--no-samples", "--price-per-hour", "2.5")
    first = in_process_json(cli, weak, strong, *args)
    assert [row["run"] for row in first["runs"]] == [strong, weak]
    assert first["runs"][0]["test_loss"] < first["runs"][1]["test_loss"]
    for row in first["runs"]:
        assert row["cost_usd"] == pytest.approx(row["gpu_hours"] * 2.5)
        # The bill is the wall time of every phase (setup, steps, evaluation, checkpoints): more than the steps.
        assert row["gpu_hours"] == pytest.approx(row["wall_seconds"] / 3600)
        assert row["wall_seconds"] > row["train_seconds"] > 0
    again = in_process_json(cli, weak, strong, *args)
    assert all(row.get("reused") for row in again["runs"])
    assert [r["test_loss"] for r in again["runs"]] == [r["test_loss"] for r in first["runs"]]
    fresh = in_process_json(cli, weak, strong, *args, "--fresh")
    assert not any(row.get("reused") for row in fresh["runs"])

    table = cli("eval", weak, strong, *args)
    assert table.returncode == 0, table.stderr[-3000:]
    rows = [line for line in table.stdout.splitlines() if strong in line or weak in line]
    # The ranking, then each run's time per phase in the same order.
    assert len(rows) == 4 and strong in rows[0] and weak in rows[1] and strong in rows[2] and weak in rows[3]
    assert "test loss" in table.stdout and "bits/byte" in table.stdout and "$" in rows[0]
    assert "time per phase" in table.stdout and "%" in rows[2]
    # Hours of the device the runs trained on: a CPU run's are not GPU-hours.
    kinds = {row["train_device_type"] for row in first["runs"]}
    assert kinds <= {"cpu", "cuda"} and len(kinds) == 1
    label, other = ("CPU-h", "GPU-h") if kinds == {"cpu"} else ("GPU-h", "CPU-h")
    assert label in table.stdout and other not in table.stdout


def test_the_device_hours_column_names_the_device_the_runs_trained_on():
    from nanopt.evaluate.compare import device_hours_label

    assert device_hours_label([{"train_device_type": "cpu"}, {"train_device_type": "cpu"}]) == "CPU-h"
    assert device_hours_label([{"train_device_type": "cuda"}]) == "GPU-h"
    assert device_hours_label([{"train_device_type": "cpu"}, {"train_device_type": "cuda"}]) == "device-h"
    assert device_hours_label([{"train_device_type": None}]) == "device-h"  # a checkpoint older than the field


def test_training_seconds_sums_logged_step_times_and_restarts_at_a_resume():
    records = [
        {"kind": "train", "step": 10, "step_time_s": 1.0},
        {"kind": "eval", "step": 10, "val_loss": 3.0},
        {"kind": "train", "step": 20, "step_time_s": 2.0},
        {"kind": "event", "step": 25, "event": "resume"},  # steps 21..25 ran in a killed session, unlogged
        {"kind": "train", "step": 30, "step_time_s": 3.0},
        {"kind": "train", "step": 40, "step_time_s": 4.0},
    ]
    assert training_seconds(records, 40) == 10 * 1 + 10 * 2 + 5 * 3 + 10 * 4
    assert training_seconds(records, 30) == 10 * 1 + 10 * 2 + 5 * 3
    assert training_seconds([{"kind": "eval", "step": 5}], 5) is None


def test_a_non_finite_loss_ranks_last():
    rows = ranked([{"run": "a", "test_loss": float("nan")}, {"run": "b", "test_loss": 4.0},
                   {"run": "c", "test_loss": 3.0}])
    assert [r["run"] for r in rows] == ["c", "b", "a"]


# --------------------------------------------------------------------------------------------- other datasets


def test_another_dataset_with_the_same_tokenizer_is_accepted(runs, tiny_dataset: Path, tmp_path: Path, cli):
    copy = shutil.copytree(tiny_dataset, tmp_path / "copy")
    result = in_process_json(cli, runs["strong"], "--data", copy, "--tokens", "1024", "--no-samples")
    assert result["dataset"] == str(copy) and result["tokenizer_check"].startswith("same tokenizer")


def test_a_dataset_with_another_tokenizer_is_refused(runs, tiny_corpus: Path, tmp_path: Path, cli):
    from nanopt.data.tokenize.pipeline import build_dataset

    # Same vocabulary size, trained on less text: the ids mean other strings, which only the hash can tell.
    other = tmp_path / "other"
    build_dataset(other, str(tiny_corpus), vocab_size=512, val_fraction=0.2, test_fraction=0.2,
                  tokenizer_sample_bytes=20_000)
    assert json.loads((other / "meta.json").read_text())["vocab_size"] == 512
    result = cli("eval", runs["strong"], "--data", other, "--no-samples")
    assert_user_error(result, "another tokenizer", "tokenizer.json sha256", "--tokenizer")
    assert not (other / "eval.json").exists()


# ------------------------------------------------------------------------------------------------------ errors


def test_user_errors_exit_2_with_a_hint(runs, tiny_dataset: Path, tmp_path: Path, cli):
    untrained = make_run(tmp_path, tiny_dataset, "untrained")
    assert_user_error(cli("eval", untrained), "no complete checkpoint", "nanopt train")
    assert_user_error(cli("eval", tmp_path / "missing"), "run directory not found")
    assert_user_error(cli("eval", runs["strong"], "--checkpoint", "step-000999"), "does not exist")
    assert_user_error(cli("eval", runs["strong"], "--tokens", "lots"), "--tokens")


def test_an_unwritable_result_is_an_error_not_a_traceback(runs, cli):
    blocker = runs["weak"] / "eval.json"  # a non-empty directory where the file should go
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.unlink(missing_ok=True)
    (blocker / "keep").mkdir(parents=True)
    try:
        result = cli("eval", runs["weak"], "--tokens", "128", "--no-samples")
        assert_user_error(result, "eval.json: is a directory, where nanopt writes a file", "move it away")  # #34
    finally:
        shutil.rmtree(blocker)
