"""A compiled run says when its training step compiles again: one line and a `recompile` event, with the step and
Dynamo's reason; a sequence-length stage's new shape as expected, anything else as a warning. The session's first
compile and evaluation's graphs (other shapes, no gradients) are not recompilations of the training step.

Dynamo runs for real, on a real run; the backend is aot_eager instead of inductor (the same graphs, forward and
backward, without C++ compilation on a 2-core CPU): when Dynamo recompiles does not depend on the backend. The
surprise is a real one too: the loader hands one step a micro-batch a row short, a shape the step was not compiled
for."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from faulthelp import TINY_MODEL
from trainhelp import make_run

# Base seq_len 16 (micro-batch 4 x 16), then 32 (2 x 32) from 0-based step 7, logged as step 8; 2 micro-batches a
# step. Evaluations at steps 5, 10 and 14 compile graphs of their own between the steps.
STAGED = {"seq_len": 16, "micro_batch_size": 4, "global_batch_tokens": 128, "max_steps": 14, "compile": True,
          "seq_len_stages": [{"from": 0.5, "seq_len": 32}], "checkpoint_interval": 14, "eval_interval": 5,
          "eval_tokens": 256, "warmup_steps": 2, "log_interval": 1}
SHORT_STEP = 4  # the step whose micro-batches come a row short


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """aot_eager, and Dynamo's caches emptied: graphs an earlier test compiled for these shapes (or its share of
    the recompile limit) would otherwise stand in for the compilations looked for here."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()


def _short_batches_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The loader hands step `step` (1-based) micro-batches of one row fewer than the run's."""
    from nanopt.data.loaders.loader import TrainLoader

    original = TrainLoader.next_batch

    def next_batch(self):
        reading = self.step
        inputs, targets = original(self)
        return (inputs[:-1], targets[:-1]) if reading == step - 1 else (inputs, targets)

    monkeypatch.setattr(TrainLoader, "next_batch", next_batch)


def test_a_recompiled_step_is_said_with_its_reason_and_a_new_stage_as_expected(
        tmp_path: Path, tiny_dataset: Path, cli_in_process, aot_eager, monkeypatch: pytest.MonkeyPatch):
    run = make_run(tmp_path, tiny_dataset, model={**TINY_MODEL, "max_position_embeddings": 32}, **STAGED)
    _short_batches_at(monkeypatch, SHORT_STEP)
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in records if r.get("event") == "recompile"]
    assert [(e["step"], e["expected"]) for e in events] == [(SHORT_STEP, False), (8, True)]
    surprise, stage = events
    assert "size mismatch at index 0. expected 4, actual 3" in surprise["reason"], surprise
    assert "size mismatch" in stage["reason"], stage  # the stage's micro-batch of 2 x 32
    assert all(e["graphs"] >= 1 and e["compile_s"] > 0 and e["function"] for e in events)
    said = [line for line in result.stderr.splitlines() if "compile" in line and line.startswith(("step", "warn"))]
    assert said[0].startswith(f"warning: step {SHORT_STEP}: the compiled training step recompiled (1 graph, "), said
    assert "; Dynamo: \"" in said[0] and "size mismatch" in said[0] and "TORCH_LOGS=recompiles" in said[0]
    assert said[1].startswith("step 8: torch.compile compiled the new sequence length's graph, as expected ("), said
    assert len(said) == 2, said


def test_a_compiled_run_without_surprises_says_nothing(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                       aot_eager):
    """Steps after the first, with accumulation and evaluations between them, reuse the graph: no line, no event."""
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **{
        **STAGED, "seq_len_stages": None, "max_steps": 8, "checkpoint_interval": 4, "eval_interval": 3})
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr
    assert "recompile" not in result.stderr and "compiled the new" not in result.stderr
    assert '"recompile"' not in (run / "metrics.jsonl").read_text()
