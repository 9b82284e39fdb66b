"""An imported run before it has a dataset: train.json's `data` is `nanopt import`'s placeholder, and every command
that needs the run's data says so in one line, with the commands that give it one, never looking the placeholder
up as a directory; the commands that need no data (eval --data, eval --no-loss, estimate) run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import tree_digest
from importhelp import llama, save

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> Path:
    """A tiny Llama with the tiny dataset's tokenizer, imported into a run that names no dataset."""
    from nanopt.importer.run import import_model

    root = tmp_path_factory.mktemp("imported")
    vocab = json.loads((tiny_dataset / "meta.json").read_text())["vocab_size"]
    source = save(llama(vocab, tied=True), root / "hf", tiny_dataset / "tokenizer.json")
    run = root / "runs" / "x"
    import_model(str(source), run)
    return run


@pytest.mark.parametrize("command", [["eval"], ["train"], ["preflight"], ["profile"],
                                     ["find-batch", "--max-memory", "4GiB"]], ids=lambda c: c[0])
def test_a_run_without_a_dataset_says_how_to_give_one(command, imported, cli_in_process):
    before = tree_digest(imported)
    tokenizer = imported / "checkpoints" / "step-000000" / "tokenizer.json"
    result = cli_in_process(command[0], imported, *command[1:])
    assert_user_error(result, f"{imported}: the run has no dataset yet", f"--tokenizer {tokenizer} --out data/NAME",
                      f"nanopt eval {imported} --data data/NAME", f"nanopt train {imported} --set data=data/NAME")
    assert "SET ME" not in result.stderr  # the placeholder is never glued into a path
    assert tree_digest(imported) == before  # nothing written


def test_eval_with_data_scores_an_imported_run(imported, tiny_dataset, cli_in_process):
    result = cli_in_process("eval", imported, "--data", tiny_dataset, "--tokens", "256", "--no-samples", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    scored = json.loads(result.stdout)
    assert scored["dataset"] == str(tiny_dataset) and scored["tokens"] == 256
    assert scored["tokenizer_check"].startswith("same tokenizer")


def test_commands_that_need_no_dataset_run(imported, cli_in_process):
    sampled = cli_in_process("eval", imported, "--no-loss", "--prompt", "the", "--max-new-tokens", "2")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    estimated = cli_in_process("estimate", imported, "--json")
    assert estimated.returncode == 0, estimated.stderr[-3000:]
