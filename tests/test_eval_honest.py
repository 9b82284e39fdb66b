"""Honest evaluation: the tokens evaluated depend only on the split, seq_len and --tokens, never on the number of
ranks or the micro-batch size; `--tokens all` scores every token of the split; the output says how many tokens
were scored, of how many; an eval.json made under the old slicing rule is never reused as if comparable.

Ranks are real gloo ranks (tests/distributed.py); datasets are copies of the shared `tiny_dataset`, cut short with
real file writes where a test needs a split smaller than one micro-batch, or without a single window.
"""

from __future__ import annotations

import hashlib
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
from faulthelp import TINY_MODEL, Launcher, tiny_run
from trainhelp import HIDE_CUDA

from nanopt.data.dataset import TokenDataset
from nanopt.data.loaders.loader import eval_batches
from nanopt.errors import DataError
from nanopt.model.loss import IGNORE_INDEX

SEQ_LEN = TINY_MODEL["max_position_embeddings"]  # 16
UNEVEN_TOKENS = 1000  # 62.5 windows of 16: divides by neither seq_len nor micro-batch x ranks


def split_stream(dataset: Path) -> np.ndarray:
    meta = json.loads((dataset / "meta.json").read_text())
    return np.concatenate([np.load(dataset / s["file"]) for s in meta["splits"]["test"]["shards"]]).astype(np.int64)


def shortened(tiny_dataset: Path, root: Path, tokens: int) -> Path:
    """A copy of the dataset whose test split holds only its first `tokens` tokens, in one shard."""
    data = Path(shutil.copytree(tiny_dataset, root / f"test-{tokens}"))
    meta = json.loads((data / "meta.json").read_text())
    split = meta["splits"]["test"]
    kept = np.load(tiny_dataset / split["shards"][0]["file"])[:tokens]
    for shard in split["shards"]:
        (data / shard["file"]).unlink()
    np.save(data / "test" / "short.npy", kept)
    split["shards"] = [{"file": "test/short.npy", "tokens": tokens,
                        "sha256": hashlib.sha256((data / "test" / "short.npy").read_bytes()).hexdigest()}]
    split["tokens"] = tokens
    (data / "meta.json").write_text(json.dumps(meta))
    return data


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A tiny model trained 4 steps: any weights do, as long as every evaluation reads the same ones."""
    path = tiny_run(tmp_path_factory.mktemp("honest"), tiny_dataset, "run", max_steps=4, eval_interval=0,
                    checkpoint_interval=4)
    child = launcher.train(path)
    assert child.returncode == 0, child.stderr[-3000:]
    return path


def eval_json(cli, *args: object) -> dict:
    result = cli("eval", *args, "--no-samples", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


# ------------------------------------------------------------------------------------------ which tokens


def expected_windows(stream: np.ndarray, targets: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The rule: the split's first `targets` targets, in seq_len windows from its start, the last one partial."""
    windows = []
    for start in range(0, targets, SEQ_LEN):
        length = min(SEQ_LEN, targets - start)
        windows.append((tuple(stream[start:start + length]), tuple(stream[start + 1:start + 1 + length])))
    return sorted(windows)


def evaluated_windows(dataset: TokenDataset, micro: int, world: int, max_tokens: int | None) -> list:
    """Every (inputs, targets) row the ranks score together, cut to its scored targets; padding scores none."""
    shares = [eval_batches(dataset, "test", SEQ_LEN, micro, rank, world, max_tokens) for rank in range(world)]
    assert len({len(share) for share in shares}) == 1  # every rank runs as many forward passes: no one waits alone
    windows = []
    for share in shares:
        for inputs, targets in share:
            assert inputs.shape == targets.shape and inputs.shape[1] == SEQ_LEN  # one shape: no recompiles
            for row_inputs, row_targets in zip(inputs.tolist(), targets.tolist(), strict=True):
                scored = sum(t != IGNORE_INDEX for t in row_targets)
                assert all(t != IGNORE_INDEX for t in row_targets[:scored])  # a prefix: its real context before it
                if scored:
                    windows.append((tuple(row_inputs[:scored]), tuple(row_targets[:scored])))
    return sorted(windows)


@pytest.mark.parametrize("max_tokens", [UNEVEN_TOKENS, None, 40], ids=["uneven", "all", "under-one-batch"])
def test_the_scored_tokens_depend_on_neither_ranks_nor_micro_batch(tiny_dataset: Path, max_tokens: int | None):
    dataset = TokenDataset.open(tiny_dataset)
    stream = split_stream(tiny_dataset)
    targets = len(stream) - 1 if max_tokens is None else max_tokens  # `all`: every token that has one before it
    expected = expected_windows(stream, targets)
    for world in (1, 2, 3):
        for micro in (3, 4):
            assert evaluated_windows(dataset, micro, world, max_tokens) == expected, (world, micro)
            assert eval_batches(dataset, "test", SEQ_LEN, micro, 0, world, max_tokens).targets == targets


def test_a_split_smaller_than_one_micro_batch_is_evaluated_and_one_without_a_window_is_an_error(
        tiny_dataset: Path, tmp_path: Path):
    short = shortened(tiny_dataset, tmp_path, 3 * SEQ_LEN + 1 + 5)  # 3 whole windows and 5 tokens after them
    dataset = TokenDataset.open(short)
    stream = split_stream(short)
    assert evaluated_windows(dataset, 4, 2, None) == expected_windows(stream, len(stream) - 1)
    empty = TokenDataset.open(shortened(tiny_dataset, tmp_path, SEQ_LEN))
    with pytest.raises(DataError, match=f"split 'test' has {SEQ_LEN} tokens, fewer than one window") as info:
        eval_batches(empty, "test", SEQ_LEN, 4, 0, 1, None)
    assert "--test-tokens" in info.value.hint


# ---------------------------------------------------------------------------------------------- the loss


def direct_loss(run: Path, dataset: Path, targets: int) -> float:
    """Mean cross-entropy over the first `targets` targets of the test split, from the weights file and the model's
    logits, one window at a time; nothing from nanopt's evaluation code."""
    from safetensors.torch import load_file

    from nanopt.config import ModelConfig
    from nanopt.model.transformer import Transformer

    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    model = Transformer(ModelConfig(**json.loads((ckpt / "meta.json").read_text())["config"]["model"]))
    model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)
    model.eval()
    stream = torch.from_numpy(split_stream(dataset))
    whole, tail = divmod(targets, SEQ_LEN)
    pieces = [(stream[:whole * SEQ_LEN].view(whole, SEQ_LEN), stream[1:whole * SEQ_LEN + 1].view(whole, SEQ_LEN)),
              (stream[None, whole * SEQ_LEN:targets], stream[None, whole * SEQ_LEN + 1:targets + 1])]
    total = 0.0
    with torch.no_grad():
        for inputs, expected in pieces:
            if inputs.numel():
                logits = model(inputs).double()
                total += F.cross_entropy(logits.flatten(0, 1), expected.flatten(), reduction="sum").item()
    return total / targets


def evaluate_on_ranks(run: Path, cases: list[tuple[int | None, int]]) -> list[dict]:
    """What `nanopt eval RUN --tokens T --micro-batch-size M --no-samples` computes on each torchrun worker, for
    each (T, M), in one process group."""
    from nanopt.evaluate.report import EvalOptions, Progress, evaluate_run
    from nanopt.runtime import init_runtime, shutdown

    rt = init_runtime("auto")
    try:
        return [evaluate_run(rt, run, EvalOptions(tokens=tokens, micro_batch_size=micro, samples=None), Progress())
                for tokens, micro in cases]
    finally:
        shutdown(rt)


def test_the_same_loss_on_one_and_two_ranks_and_any_micro_batch(run: Path, tiny_dataset: Path, cli_in_process):
    split_tokens = len(split_stream(tiny_dataset))
    cases = [("all", None, split_tokens - 1), (str(UNEVEN_TOKENS), UNEVEN_TOKENS, UNEVEN_TOKENS)]
    rank0, rank1 = run_ranks(evaluate_on_ranks, run, [(tokens, 4) for _, tokens, _ in cases], env=HIDE_CUDA)
    for (option, _, scored), two_ranks, other_rank in zip(cases, rank0, rank1, strict=True):
        one_rank = {micro: eval_json(cli_in_process, run, "--tokens", option, "--micro-batch-size", micro)
                    for micro in (3, 4)}
        direct = direct_loss(run, tiny_dataset, scored)
        for result in (*one_rank.values(), two_ranks, other_rank):
            assert result["tokens"] == scored and result["split_tokens"] == split_tokens
            assert result["test_loss"] == pytest.approx(direct, rel=1e-6), option
        assert two_ranks["world_size"] == 2 and one_rank[3]["world_size"] == 1


def train_in_rank(run: Path) -> dict:
    """What `nanopt train RUN` does in each torchrun worker: the run's summary."""
    from nanopt.config import load_run
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run), TrainOptions())


def test_in_loop_validation_with_a_rank_short_of_a_batch_finishes_under_fsdp(tiny_dataset: Path, tmp_path: Path):
    # 80 validation tokens = 5 windows of 16 in 3 batches of 2 rows: rank 0 scores two, rank 1 one and then runs a
    # batch of padding alone, as each FSDP forward pass gathers the weights from both ranks.
    path = tiny_run(tmp_path, tiny_dataset, "fsdp", parallelism="fsdp", max_steps=2, eval_interval=2, eval_tokens=80,
                    checkpoint_interval=2)
    rank0, rank1 = run_ranks(train_in_rank, path, env=HIDE_CUDA)
    assert rank0["completed"] and rank0["final_val_loss"] == rank1["final_val_loss"]
    [record] = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "eval"]
    assert record["val_tokens"] == 80 and record["val_loss"] == rank0["final_val_loss"]


# -------------------------------------------------------------------------------------------- the report


def test_the_output_says_how_many_tokens_were_scored_of_how_many(run: Path, tiny_dataset: Path, cli_in_process):
    split_tokens = len(split_stream(tiny_dataset))
    result = cli_in_process("eval", run, "--tokens", UNEVEN_TOKENS, "--no-samples")
    assert result.returncode == 0, result.stderr[-3000:]
    share = f"{100 * UNEVEN_TOKENS / split_tokens:.1f}%"
    assert f"{UNEVEN_TOKENS:,} of {split_tokens:,} tokens evaluated ({share})" in result.stdout
    recorded = json.loads((run / "eval.json").read_text())
    assert recorded["tokens"] == UNEVEN_TOKENS and recorded["split_tokens"] == split_tokens


def test_a_tiny_split_is_evaluated_through_the_cli_and_an_empty_one_is_a_user_error(
        run: Path, tiny_dataset: Path, tmp_path: Path, cli_in_process):
    short = shortened(tiny_dataset, tmp_path, 3 * SEQ_LEN + 1 + 5)
    # A micro-batch far past the split's 4 windows: evaluated as it is, in batches of its 4 windows, not 100,000 rows.
    result = eval_json(cli_in_process, run, "--data", short, "--tokens", "all", "--micro-batch-size", 100_000)
    assert result["tokens"] == 3 * SEQ_LEN + 5 and result["split_tokens"] == 3 * SEQ_LEN + 6
    assert math.isfinite(result["test_loss"])
    empty = shortened(tiny_dataset, tmp_path, SEQ_LEN)
    assert_user_error(cli_in_process("eval", run, "--data", empty, "--no-samples"),
                      f"split 'test' has {SEQ_LEN} tokens, fewer than one window", "--test-tokens")


def test_an_eval_json_made_under_the_old_slicing_rule_is_not_reused(run: Path, tmp_path: Path, cli_in_process):
    other = Path(shutil.copytree(run, tmp_path / "other"))
    fresh = eval_json(cli_in_process, other, "--tokens", "1024")  # 64 windows: a slice the old rule took too
    ckpt_eval = other / "checkpoints" / "step-000004" / "eval.json"

    def plant(settings: dict) -> None:
        """An eval.json for this checkpoint whose number is recognisably not the one computed now."""
        ckpt_eval.write_text(json.dumps({**fresh, "settings": settings, "test_loss": 123.0}))

    plant(fresh["settings"])  # made under today's rule: reused, as the comparison promises
    reused = eval_json(cli_in_process, other, run, "--tokens", "1024")["runs"]
    assert {r["test_loss"] for r in reused if r["run"] == str(other)} == {123.0}
    old_settings = {key: value for key, value in fresh["settings"].items() if key in (
        "split", "weights_sha256", "data_fingerprint", "tokenizer_sha256", "seq_len", "max_tokens", "tokens",
        "precision", "samples")}  # what the old rule recorded: the same keys, no rule
    assert old_settings != fresh["settings"]
    plant(old_settings)
    (other / "eval_history.jsonl").unlink()  # it holds today's result, which would be reused (rightly) instead
    compared = eval_json(cli_in_process, other, run, "--tokens", "1024")["runs"]
    [again] = [r for r in compared if r["run"] == str(other)]
    assert not again.get("reused") and again["test_loss"] == pytest.approx(fresh["test_loss"], rel=1e-9)


# A stored result from someone else's run: what it measured is checked before it is reused; the rest is worked out
# again. Each entry: (what is planted over a result made with the same settings, the note's words).
MALFORMED = {
    "loss-text": ({"test_loss": "abc"}, "test_loss is 'abc', not a finite number"),
    "loss-nan": ({"test_loss": float("nan")}, "test_loss is nan"),
    "loss-negative": ({"test_loss": -1.0}, "test_loss is -1.0, not a finite number >= 0"),
    "tokens": ({"tokens": -5}, "it scored -5 tokens, this evaluation 1,024"),
    "samples": ({"samples": 7}, "samples is 7, not a list"),
    "sample": ({"samples": [{"prompt": "a", "ended": True}]}, "samples[0].completion is None, not a string"),
    "tasks": ({"tasks": {"hellaswag": {"acc": {"value": "high"}}}}, "tasks.hellaswag.acc.value is 'high'"),
    "sources": ({"sources": {"web": {"test_loss": 1.0, "tokens": 3}}}, "it scored the sources ['web']"),
    "device": ({"device": ["cuda"] * 50}, "device is ['cuda', 'cuda', 'cuda', 'cuda', 'cuda',... (400 characters), "
                                          "not a string"),
    "loss-huge": ({"test_loss": 10 ** 400}, "test_loss is an integer of about 401 digits, not a finite number"),
}


@pytest.mark.parametrize("planted", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_stored_result_with_a_wrong_measured_value_is_evaluated_again(planted, run: Path, tmp_path: Path,
                                                                        cli_in_process):
    other = Path(shutil.copytree(run, tmp_path / "other"))
    fresh = eval_json(cli_in_process, other, "--tokens", "1024")
    (other / "eval_history.jsonl").unlink()  # it holds today's result, which would be reused (rightly) instead
    (other / "checkpoints" / "step-000004" / "eval.json").write_text(json.dumps({**fresh, **planted[0]}))
    result = cli_in_process("eval", other, run, "--tokens", "1024", "--no-samples", "--json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    [again] = [r for r in json.loads(result.stdout)["runs"] if r["run"] == str(other)]
    assert not again.get("reused") and again["test_loss"] == pytest.approx(fresh["test_loss"], rel=1e-9)
    assert f"was not reused ({planted[1]}" in result.stderr.replace("\n", " "), result.stderr


def test_a_reused_result_takes_only_what_was_measured_and_works_out_the_rest(run: Path, tmp_path: Path,
                                                                            cli_in_process):
    """Which run and step, the training's cost, perplexity and bits per byte are not taken from the file: forged
    ones (that would crash the report, or misstate the run) are replaced; the stored loss stands for the weights."""
    other = Path(shutil.copytree(run, tmp_path / "other"))
    fresh = eval_json(cli_in_process, other, "--tokens", "1024")
    forged = {"run": 5, "step": "x", "perplexity": [1], "bits_per_byte": "z", "train_sessions": "many",
              "parameters": -1, "test_loss": 2.5}
    (other / "checkpoints" / "step-000004" / "eval.json").write_text(json.dumps({**fresh, **forged}))
    result = eval_json(cli_in_process, other, run, "--tokens", "1024")
    [reused] = [r for r in result["runs"] if r["run"] == str(other)]
    assert reused["reused"] and reused["test_loss"] == 2.5 and reused["step"] == fresh["step"]
    assert reused["perplexity"] == pytest.approx(math.exp(2.5))
    assert reused["bits_per_byte"] == pytest.approx(2.5 / math.log(2) / fresh["bytes_per_token"])
    assert reused["parameters"] == fresh["parameters"] and reused["train_sessions"] == fresh["train_sessions"]
    assert set(reused) - {"reused"} == set(fresh)  # every field a fresh result has
