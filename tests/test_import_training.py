"""An imported model is a run like any other: continued pretraining resumes exactly after a SIGKILL, trains on two
gloo ranks under DDP and FSDP2 as in one process, refuses a dataset made with another tokenizer before any step,
and `nanopt eval` and `nanopt export` read the freshly imported checkpoint (the test loss and the exported logits
are the source model's)."""

from __future__ import annotations

import json
import math
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from clihelp import assert_user_error
from conftest import TINY_SETTINGS, english_like_documents, write_jsonl
from distributed import run_ranks
from faulthelp import tree_digest
from importhelp import llama, save
from trainhelp import HIDE_CUDA, eval_losses, final_weights_hash, losses

from nanopt.train import checkpoint as ckpt

transformers = pytest.importorskip("transformers")

# The imported model is importhelp.llama's (hidden 32, 2 layers, GQA, untied, max_position_embeddings 32). These
# replace the import's continued-pretraining defaults, as a user edits train.json: tiny batches, fp32, no compile.
TINY_TRAIN = {"micro_batch_size": 4, "seq_len": 32, "global_batch_tokens": 4 * 32 * 2, "max_steps": 12,
              "learning_rate": 3e-3, "warmup_steps": 3, "eval_interval": 6, "eval_tokens": 256,
              "checkpoint_interval": 4, "keep_checkpoints": 5, "log_interval": 1, "seed": 7, "precision": "fp32",
              "compile": False}


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_dataset: Path) -> tuple[Path, torch.nn.Module]:
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    model = llama(vocab, tied=False)
    return save(model, tmp_path_factory.mktemp("hf") / "llama", tiny_dataset / "tokenizer.json"), model


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory) -> Path:
    """One import; each test trains a copy of it (as a user would import again)."""
    from nanopt.importer.run import import_model

    run = tmp_path_factory.mktemp("runs") / "imported"
    import_model(str(source[0]), run)
    return run


def _copy(imported: Path, root: Path, name: str, data: Path | None = None, **train: Any) -> Path:
    """A copy of the imported run whose train.json the user has edited: `data` set and `train` over the defaults."""
    run = Path(shutil.copytree(imported, root / name, symlinks=True))
    if data is not None or train:
        path = run / "train.json"
        edited = {**json.loads(path.read_text()), **({"data": str(data)} if data else {}), **train}
        if "max_steps" in train:  # the import's budget is train_tokens: one of the two, as train.json requires
            edited.pop("train_tokens")
        path.write_text(json.dumps(edited, indent=2))
    return run


def _started_from_import(run: Path) -> bool:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return any(e.get("event") == "resume" and e.get("checkpoint") == "step-000000" for e in events)


def test_continued_pretraining_resumes_identically_after_sigkill(imported, tiny_dataset, tmp_path, launcher):
    """Killed as it reads step 10's first batch once step 8 is saved: the resumed run's losses, evaluations and
    final weights are the uninterrupted run's, bit for bit (CPU)."""
    straight = _copy(imported, tmp_path, "straight", tiny_dataset, **TINY_TRAIN)
    killed = _copy(imported, tmp_path, "killed", tiny_dataset, **TINY_TRAIN)
    launcher.train(straight)
    child = launcher.start("train", killed, "--no-live", kill_at_step={
        "step": 10, "checkpoints": str(killed / "checkpoints"), "latest": "step-000008"})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"
    assert ckpt.read_pointer(killed / "checkpoints", "latest") == "step-000008"
    result = launcher.train(killed)
    assert "resumed from" in result.stderr and "step 8" in result.stderr
    a, b = losses(straight), losses(killed)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s] for s in range(9, 13)] == [b[s] for s in range(9, 13)]
    assert final_weights_hash(straight) == final_weights_hash(killed)
    assert eval_losses(straight) == eval_losses(killed) and sorted(eval_losses(straight)) == [6, 12]
    assert _started_from_import(straight) and _started_from_import(killed)
    assert a[12] < a[1]


def train_in_rank(run: Path) -> dict[str, Any]:
    """What `nanopt train RUN` does in each torchrun worker, without the CLI's rendering: the run's summary."""
    from nanopt.config import load_run
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run), TrainOptions())


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_gloo_ranks_train_an_import_as_one_process(parallelism, imported, tiny_dataset, tmp_path, launcher):
    """1 process x accumulation 2 and 2 gloo ranks x accumulation 1 start from the imported weights on every rank
    and log the same losses (up to summation order)."""
    train = {**TINY_TRAIN, "max_steps": 8, "eval_interval": 0, "checkpoint_interval": 8, "parallelism": parallelism}
    single = _copy(imported, tmp_path, "single", tiny_dataset, **train)
    double = _copy(imported, tmp_path, "double", tiny_dataset, **train)
    launcher.train(single)
    rank0, rank1 = run_ranks(train_in_rank, double, env=HIDE_CUDA)
    assert rank0["completed"] and rank0["final_train_loss"] == rank1["final_train_loss"]
    meta = json.loads((double / "checkpoints" / rank0["latest_checkpoint"] / "meta.json").read_text())
    assert meta["world_size"] == 2 and "weights_only" not in meta
    one, two = losses(single), losses(double)
    assert sorted(one) == sorted(two) == list(range(1, 9))
    worst = max(abs(one[s] - two[s]) for s in one)
    assert worst <= 1e-5, f"largest per-step loss difference {worst}"
    assert _started_from_import(single) and _started_from_import(double)


@pytest.fixture(scope="module")
def other_tokenizer_dataset(tmp_path_factory) -> Path:
    """A dataset with a 512-token vocabulary, like tiny_dataset's, from a BPE trained on another corpus: the ids
    fit the imported model, and mean other words."""
    from nanopt.data.tokenize.pipeline import build_dataset

    root = tmp_path_factory.mktemp("other")
    corpus = write_jsonl(root / "other.jsonl", english_like_documents(150, seed=11))
    out = root / "data"
    build_dataset(out, str(corpus), **TINY_SETTINGS)
    return out


def test_dataset_of_another_tokenizer_is_refused_before_any_step(imported, other_tokenizer_dataset, tiny_dataset,
                                                                  tmp_path, cli_in_process):
    other = json.loads((other_tokenizer_dataset / "meta.json").read_text())
    assert other["vocab_size"] <= 512  # it fits the model: only the tokenizer check can refuse it
    assert (other_tokenizer_dataset / "tokenizer.json").read_bytes() != (tiny_dataset / "tokenizer.json").read_bytes()
    run = _copy(imported, tmp_path, "run", other_tokenizer_dataset, **TINY_TRAIN)
    before = tree_digest(run / "checkpoints")
    result = cli_in_process("train", run, "--no-live")
    assert_user_error(result, "another tokenizer", "--tokenizer")
    assert tree_digest(run / "checkpoints") == before
    logged = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""
    assert '"kind": "train"' not in logged


def _test_split_loss(model: torch.nn.Module, dataset: Path, targets: int, seq_len: int) -> float:
    """transformers' mean loss over the test split's first `targets` targets in seq_len windows (eval's slice)."""
    import numpy as np

    from nanopt.data.dataset import TokenDataset

    tokens = np.empty(targets + 1, dtype=np.int64)
    TokenDataset.open(dataset).stream("test").read(0, tokens)
    ids = torch.from_numpy(tokens)
    total = 0.0
    with torch.no_grad():
        for start in range(0, targets, seq_len):
            window = ids[start:min(start + seq_len, targets) + 1]
            logits = model(window[None, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
    return total / targets


def test_eval_of_a_fresh_import_is_the_source_models_loss(imported, source, tiny_dataset, cli_in_process):
    """`nanopt eval RUN --data DIR` on the step-0 checkpoint: the test loss transformers computes with the source
    model on the same tokens; samples come from the carried tokenizer. Without --data (the checkpoint records no
    dataset yet) it says, in one line, to pass one."""
    assert_user_error(cli_in_process("eval", imported), "--data", "--tokenizer")
    result = cli_in_process("eval", imported, "--data", tiny_dataset, "--tokens", "200", "--max-new-tokens", "4",
                            "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    report = report[0] if isinstance(report, list) else report
    expected = _test_split_loss(source[1], tiny_dataset, 200, seq_len=32)
    assert math.isclose(report["test_loss"], expected, abs_tol=1e-5), (report["test_loss"], expected)
    assert report["samples"] and all(isinstance(s["completion"], str) for s in report["samples"])


def test_export_cli_of_a_fresh_import_gives_the_source_logits(imported, source, tiny_dataset, tmp_path,
                                                               cli_in_process):
    from tokenizers import Tokenizer

    out = tmp_path / "exported"
    result = cli_in_process("export", imported, "--out", out)
    assert result.returncode == 0, result.stderr
    text = "the optimizer learns every batch again and again"
    tokens = torch.tensor([Tokenizer.from_file(str(tiny_dataset / "tokenizer.json")).encode(text).ids])
    again = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, source[1](tokens).logits, atol=1e-5, rtol=0)
    exported_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert exported_tok(text)["input_ids"] == tokens[0].tolist()


def test_retention_keeps_the_imported_model_the_run_continues_from(imported, tiny_dataset, tmp_path, cli_in_process):
    """keep_checkpoints 2 over 12 steps saved at 4, 8 and 12: the newest two stay, and so does step-000000, the
    imported weights the run is compared against (re-importing may not give them back: a revision gone, no network),
    while step-000004 goes."""
    run = _copy(imported, tmp_path, "kept", tiny_dataset, **{**TINY_TRAIN, "keep_checkpoints": 2})
    assert cli_in_process("train", run, "--no-live").returncode == 0
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == \
        ["step-000000", "step-000008", "step-000012"]
    meta = json.loads((run / "checkpoints" / "step-000000" / "meta.json").read_text())
    assert meta["imported_from"]["source"]


def test_a_fresh_start_of_an_imported_run_starts_again_from_the_import(imported, tiny_dataset, tmp_path,
                                                                      cli_in_process):
    """`--resume none` after 12 steps: the earlier checkpoints and metrics go to previous/, step-000000 stays, and
    the new run starts from the imported weights: its losses are the first run's, step for step (the same seed and
    batches), where random weights would start near ln(vocab)."""
    run = _copy(imported, tmp_path, "again", tiny_dataset, **TINY_TRAIN)
    assert cli_in_process("train", run, "--no-live").returncode == 0
    first = losses(run)
    again = cli_in_process("train", run, "--no-live", "--resume", "none")
    assert again.returncode == 0, again.stderr
    assert "starting again from the imported weights (step-000000)" in again.stderr
    assert losses(run) == first and _started_from_import(run)
    (aside,) = (run / "previous").iterdir()
    assert sorted(p.name for p in (aside / "checkpoints").glob("step-*")) == \
        ["step-000004", "step-000008", "step-000012"]
    assert (aside / "metrics.jsonl").is_file() and (aside / "checkpoints" / "latest").is_file()
    assert json.loads((run / "checkpoints" / "step-000000" / "meta.json").read_text())["imported_from"]


def test_a_fresh_start_from_damaged_imported_weights_is_refused_and_moves_nothing(imported, tiny_dataset, tmp_path,
                                                                                  cli_in_process):
    run = _copy(imported, tmp_path, "damaged", tiny_dataset, **TINY_TRAIN)
    assert cli_in_process("train", run, "--no-live").returncode == 0
    weights = next((run / "checkpoints" / "step-000000").glob("*.safetensors"))
    with weights.open("r+b") as file:
        file.seek(-4, 2)
        file.write(b"\x00\x01\x02\x03")
    before = tree_digest(run)
    result = cli_in_process("train", run, "--no-live", "--resume", "none")
    assert_user_error(result, "cannot start again from the imported weights", "checksum mismatch",
                      "import the model again")
    assert tree_digest(run) == before and not (run / "previous").exists()
