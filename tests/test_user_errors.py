"""A catalogue of mistakes a user makes, across every command: each is one line on stderr with a hint, exit status
2, no traceback, and nothing written or overwritten (every file under the run, the datasets and the output paths is
hashed before and after).

`estimate`, `tokenize`, `find-batch`, `profile`, `eval` and `export` run in this process through the CLI's entry
point (its output is the same, without a 3 s import per case); `train` runs as its own process, forked from a warm
launcher (tests/faulthelp.py) or, for torchrun and one plain case, as `python -m nanopt`. tests/test_config.py has
more model.json / train.json mistakes; these are other ones.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from clihelp import assert_user_error, run_cli
from conftest import english_like_documents, write_jsonl
from faulthelp import TINY_MODEL, TINY_TRAIN, Launcher, tiny_run, tree_digest
from trainhelp import make_run


@dataclass
class World:
    """What a case may use: its own directory, the shared dataset and trained run (copy before changing them)."""

    root: Path
    dataset: Path
    trained: Path
    other_tokenizer: Path
    corpus: Path

    def copy(self, path: Path, name: str | None = None) -> Path:
        return Path(shutil.copytree(path, self.root / (name or path.name)))

    def run(self, name: str = "run", **train) -> Path:
        return tiny_run(self.root, self.dataset, name, **train)


@dataclass
class Case:
    argv: list[object]
    expect: tuple[str, ...]  # fragments of the one error line
    runner: str = "in-process"  # or "fork" (a forked `nanopt` process) or "subprocess" (`python -m nanopt`)
    after_start: bool = False  # found by the first training step: the run's own start-up line comes first
    watch: list[Path] = field(default_factory=list)  # besides the case's own directory and the shared inputs


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


def rewrite_shards(dataset: Path, change: Callable[[np.ndarray], np.ndarray], reseal: bool = False) -> None:
    """Change every train shard in place; with reseal, also record the new checksums in meta.json, as a buggy
    tokenizer would have written them (so only the token-id check can catch what is wrong)."""
    for shard in sorted((dataset / "train").glob("*.npy")):
        np.save(shard, change(np.load(shard)))
    if reseal:
        meta = json.loads((dataset / "meta.json").read_text())
        for shard in meta["splits"]["train"]["shards"]:
            shard["sha256"] = hashlib.sha256((dataset / shard["file"]).read_bytes()).hexdigest()
        (dataset / "meta.json").write_text(json.dumps(meta))


# -------------------------------------------------------------------------------------------------- estimate


def estimate_malformed_json(w: World) -> Case:
    run = w.run()
    (run / "model.json").write_text('{"architecture": "llama", "vocab_size": 512,}')
    return Case(["estimate", run], ("model.json: malformed JSON at line 1", "trailing comma"))


def estimate_impossible_shape(w: World) -> Case:
    run = w.run()
    edit_json(run / "model.json", num_attention_heads=3, num_key_value_heads=3)
    return Case(["estimate", run], ("key 'num_attention_heads': 3 does not divide hidden_size 16",))


def estimate_unknown_gpu(w: World) -> Case:
    return Case(["estimate", w.run(), "--gpu", "quantum-9000"], ("unknown GPU 'quantum-9000'", "--peak-tflops"))


def estimate_unreadable_size(w: World) -> Case:
    return Case(["estimate", w.run(), "--gpu-memory", "lots"], ("--gpu-memory: cannot read size 'lots'",))


def estimate_nothing_to_estimate(w: World) -> Case:
    return Case(["estimate"], ("needs a run directory or --params",))


# -------------------------------------------------------------------------------------------------- tokenize


def tokenize_over_existing_dataset(w: World) -> Case:
    existing = w.copy(w.dataset, "data")
    return Case(["tokenize", w.corpus, "--out", existing, "--vocab-size", "300"], ("already exists", "--force"))


def tokenize_missing_source(w: World) -> Case:
    return Case(["tokenize", w.root / "nowhere.jsonl", "--out", w.root / "new", "--vocab-size", "300"],
                ("nowhere.jsonl: no such file or directory",))


def tokenize_wrong_text_column(w: World) -> Case:
    return Case(["tokenize", w.corpus, "--out", w.root / "new", "--vocab-size", "300", "--text-column", "body"],
                ("no text column 'body'", "--text-column"))


def tokenize_unreadable_token_count(w: World) -> Case:
    return Case(["tokenize", w.corpus, "--out", w.root / "new", "--vocab-size", "300", "--max-tokens", "lots"],
                ("--max-tokens 'lots' is not a token count",))


def tokenize_vocabulary_too_small(w: World) -> Case:
    return Case(["tokenize", w.corpus, "--out", w.root / "new", "--vocab-size", "3"], ("--vocab-size 3",))


def tokenize_impossible_split(w: World) -> Case:
    return Case(["tokenize", w.corpus, "--out", w.root / "new", "--vocab-size", "300", "--val-fraction", "1.5"],
                ("--val-fraction 1.5 is outside [0, 1)",))


# ------------------------------------------------------------------------------------------ find-batch, profile


def find_batch_on_cpu_without_a_bound(w: World) -> Case:
    return Case(["find-batch", w.run()], ("on the CPU nothing runs out of memory", "--max-memory"))


def find_batch_model_vocab_smaller_than_the_data(w: World) -> Case:
    run = w.run()
    edit_json(run / "model.json", vocab_size=256)
    return Case(["find-batch", run, "--max-memory", "2GiB"], ("has 512 token ids but the model's vocab_size is 256",))


def profile_zero_steps(w: World) -> Case:
    return Case(["profile", w.run(), "--steps", "0"], ("--steps >= 1",))


def profile_missing_dataset(w: World) -> Case:
    run = w.run()
    edit_json(run / "train.json", data=str(w.root / "no-such-data"))
    return Case(["profile", run], ("no-such-data: dataset directory not found", "nanopt tokenize"))


# ----------------------------------------------------------------------------------------------------- train


def train_run_directory_missing(w: World) -> Case:
    return Case(["train", w.root / "no-such-run"], ("no-such-run: run directory not found",), "subprocess")


def train_unknown_key(w: World) -> Case:
    run = w.run()
    edit_json(run / "train.json", learning_rat=1e-3)
    return Case(["train", run], ("unknown key 'learning_rat'", "did you mean 'learning_rate'"), "fork")


def train_wrong_type(w: World) -> Case:
    run = w.run()
    edit_json(run / "train.json", micro_batch_size="2")
    return Case(["train", run], ("key 'micro_batch_size': expected an integer",), "fork")


def train_inexact_batch(w: World) -> Case:
    return Case(["train", w.run(global_batch_tokens=100)], ("is not a multiple of", "values that work"), "fork")


def train_set_without_value(w: World) -> Case:
    return Case(["train", w.run(), "--set", "learning_rate"], ("--set 'learning_rate': expected KEY=VALUE",), "fork")


def train_dataset_missing(w: World) -> Case:
    run = w.run()
    edit_json(run / "train.json", data=str(w.root / "no-such-data"))
    return Case(["train", run], ("dataset directory not found",), "fork")


def train_dataset_without_meta(w: World) -> Case:
    (w.root / "half-made").mkdir()
    run = w.run()
    edit_json(run / "train.json", data=str(w.root / "half-made"))
    return Case(["train", run], ("incomplete dataset (no meta.json",), "fork")


def train_dataset_meta_not_json(w: World) -> Case:
    data = w.copy(w.dataset, "data")
    run = tiny_run(w.root, data, "run")
    (data / "meta.json").write_text('{"format": "nanopt-tokens", ')
    return Case(["train", run], ("meta.json: malformed JSON", "--force"), "fork")


def train_split_shorter_than_one_sequence(w: World) -> Case:
    # A budget past the split's end is trained as several epochs; a split without one sequence cannot train at all.
    tokens = json.loads((w.other_tokenizer / "meta.json").read_text())["splits"]["train"]["tokens"]
    run = make_run(w.root, w.other_tokenizer, "run", model={**TINY_MODEL, "max_position_embeddings": tokens},
                   **{**TINY_TRAIN, "micro_batch_size": 1, "global_batch_tokens": tokens})
    return Case(["train", run], (f"split 'train' has {tokens:,} tokens, fewer than one training sequence of "
                                 f"seq_len + 1 = {tokens + 1:,}", "lower seq_len"), "fork")


def train_model_vocab_smaller_than_the_data(w: World) -> Case:
    run = w.run()
    edit_json(run / "model.json", vocab_size=256)
    return Case(["train", run], ("its tokenizer has 512 token ids but the model's vocab_size is 256",
                                 "set vocab_size to at least 512"), "fork")


def train_token_ids_out_of_range(w: World) -> Case:
    data = w.copy(w.dataset, "data")

    def corrupt(tokens: np.ndarray) -> np.ndarray:
        tokens = tokens.copy()
        tokens[::5] = 60_000  # same dtype and length, so the shard headers still match meta.json
        return tokens

    rewrite_shards(data, corrupt, reseal=True)
    run = tiny_run(w.root, data, "run")
    return Case(["train", run], ("split 'train' holds token id 60,000 at step 1",
                                 "outside the dataset's vocabulary of 512 ids"), "fork")


def train_shard_with_another_dtype(w: World) -> Case:
    data = w.copy(w.dataset, "data")
    rewrite_shards(data, lambda tokens: tokens.astype(np.uint32))
    run = tiny_run(w.root, data, "run")
    return Case(["train", run], ("tokens are uint32 but meta.json says uint16",), "fork")


def train_resume_with_another_seed(w: World) -> Case:
    run = w.copy(w.trained)
    edit_json(run / "train.json", seed=8)
    return Case(["train", run], ("cannot resume", "train.seed: 7 -> 8", "start a new run directory"), "fork")


def train_resume_missing_checkpoint(w: World) -> Case:
    run = w.copy(w.trained)
    return Case(["train", run, "--resume", "step-000999"], ("checkpoint 'step-000999' does not exist",
                                                            "step-000040"), "fork")


def train_resume_name_outside_the_run(w: World) -> Case:
    # Another run's checkpoint reached by a name with '..': it exists, but is not this run's.
    run = w.copy(w.trained, "run")
    w.copy(w.trained, "other")
    name = "../../other/checkpoints/step-000040"
    assert (run / "checkpoints" / name).is_dir() and not Path(name).exists()
    return Case(["train", run, "--resume", name], ("without '/' or '..'",), "fork")


# ------------------------------------------------------------------------------------------------ eval, export


def eval_data_with_another_tokenizer(w: World) -> Case:
    return Case(["eval", w.trained, "--data", w.other_tokenizer, "--no-samples"],
                ("was made with another tokenizer", "--tokenizer"))


def eval_best_without_in_loop_eval(w: World) -> Case:
    return Case(["eval", w.trained, "--checkpoint", "best", "--no-samples"], ("no 'best' checkpoint yet",))


def eval_corrupted_checkpoint_chosen_explicitly(w: World) -> Case:
    run = w.copy(w.trained)
    weights = run / "checkpoints" / "step-000040" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    return Case(["eval", run, "--checkpoint", "step-000040", "--no-samples"], ("checksum mismatch",))


def eval_checkpoint_name_outside_the_run(w: World) -> Case:
    w.copy(w.trained, "other")
    return Case(["eval", w.trained, "--checkpoint", "../../other/checkpoints/step-000040", "--no-samples"],
                ("without '/' or '..'",))


def export_into_a_non_empty_directory(w: World) -> Case:
    out = w.root / "exported"
    out.mkdir()
    (out / "notes.txt").write_text("mine, keep me")
    return Case(["export", w.trained, "--out", out], ("already exists and is not empty", "--force"))


def export_missing_checkpoint(w: World) -> Case:
    return Case(["export", w.trained, "--checkpoint", "step-000999", "--out", w.root / "exported"],
                ("checkpoint 'step-000999' does not exist",))


CASES = [estimate_malformed_json, estimate_impossible_shape, estimate_unknown_gpu, estimate_unreadable_size,
         estimate_nothing_to_estimate, tokenize_over_existing_dataset, tokenize_missing_source,
         tokenize_wrong_text_column, tokenize_unreadable_token_count, tokenize_vocabulary_too_small,
         tokenize_impossible_split, find_batch_on_cpu_without_a_bound, find_batch_model_vocab_smaller_than_the_data,
         profile_zero_steps, profile_missing_dataset, train_run_directory_missing, train_unknown_key,
         train_wrong_type, train_inexact_batch, train_set_without_value, train_dataset_missing,
         train_dataset_without_meta, train_dataset_meta_not_json, train_split_shorter_than_one_sequence,
         train_model_vocab_smaller_than_the_data, train_token_ids_out_of_range, train_shard_with_another_dtype,
         train_resume_with_another_seed, train_resume_missing_checkpoint,
         train_resume_name_outside_the_run, eval_data_with_another_tokenizer, eval_best_without_in_loop_eval,
         eval_corrupted_checkpoint_chosen_explicitly, eval_checkpoint_name_outside_the_run,
         export_into_a_non_empty_directory, export_missing_checkpoint]


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A finished 40-step run with checkpoints at 20 and 40 and no in-loop eval (so no `best`)."""
    run = tiny_run(tmp_path_factory.mktemp("trained"), tiny_dataset, "trained", checkpoint_interval=20,
                   eval_interval=0)
    launcher.train(run)
    return run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "small.jsonl", english_like_documents(60, seed=3))


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A dataset of the same kind of text, made with another (smaller) tokenizer."""
    from nanopt.data.tokenize.pipeline import build_dataset

    out = tmp_path_factory.mktemp("other") / "data"
    build_dataset(out, str(corpus), vocab_size=300, val_fraction=0.1, test_fraction=0.2)
    return out


def snapshot(paths: list[Path]) -> dict[str, dict[str, str] | bool]:
    """Each path's files and their hashes, and whether the path exists at all."""
    return {str(p): tree_digest(p) if p.is_dir() else p.exists() for p in paths}


@pytest.mark.parametrize("make_case", CASES, ids=[c.__name__ for c in CASES])
def test_user_mistake_is_one_line_exit_2_and_writes_nothing(make_case, tmp_path: Path, tiny_dataset: Path,
                                                            trained: Path, other_tokenizer: Path, corpus: Path,
                                                            launcher: Launcher, cli_in_process):
    world = World(tmp_path, tiny_dataset, trained, other_tokenizer, corpus)
    case = make_case(world)
    watched = [tmp_path, tiny_dataset, trained, other_tokenizer, corpus.parent, *case.watch]
    before = snapshot(watched)
    if case.runner == "fork":
        child = launcher.run(*case.argv, "--no-live")
        result = SimpleNamespace(returncode=child.status, stderr=child.stderr)
    elif case.runner == "subprocess":
        result = run_cli(*case.argv, timeout=180)
    else:
        result = cli_in_process(*case.argv)
    if case.after_start:  # the start-up line, then the error: nothing else
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 2 and "parameters," in lines[0], result.stderr
        result.stderr = lines[1] + "\n"
    assert_user_error(result, *case.expect)
    assert snapshot(watched) == before


def test_the_catalogue_spans_every_command():
    commands = {case.__name__.split("_")[0].replace("find", "find-batch") for case in CASES}
    assert commands == {"estimate", "tokenize", "find-batch", "profile", "train", "eval", "export"}
    assert len(CASES) >= 25


def test_python_m_nanopt_without_its_dependencies_says_how_to_install():
    """A Python that lacks typer (the system one, not .venv's): one line with the install command, not a traceback."""
    import subprocess
    import sys

    from clihelp import REPO

    hide_typer = ("import runpy, sys; sys.modules['typer'] = None; sys.argv = ['nanopt', '--help']; "
                  "runpy.run_module('nanopt', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide_typer], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert_user_error(result, "dependency 'typer'", "make install")
