"""In-loop downstream tasks under `compile: true` on the CPU: their fixed-shape batches compile once, at the
first evaluation that scores them, and never again (a recompilation per evaluation would cost a GPU run minutes
each time); their time is in the eval phase of the phase table. Dynamo runs for real; the backend is aot_eager
(as in tests/test_compile_wiring.py: where graphs break and what recompiles does not depend on the backend)."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
from taskdata import write_task_data
from trainhelp import make_run


@pytest.mark.slow
def test_in_loop_tasks_add_no_recompilation_and_their_time_is_in_the_eval_phase(tmp_path: Path, tiny_dataset: Path,
                                                                                 monkeypatch, cli_in_process):
    from torch._dynamo.backends.registry import lookup_backend

    compiled_at = []

    def backend(graph, example_inputs):  # aot_eager, noting when each graph (a recompilation too) is compiled
        compiled_at.append(time.time())
        return lookup_backend("aot_eager")(graph, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch._dynamo.reset()
    run = make_run(tmp_path, tiny_dataset, "run", max_steps=6, eval_interval=2, checkpoint_interval=6,
                   eval_tokens=256, compile=True, downstream_tasks="all", downstream_examples=2,
                   downstream_task_data=str(write_task_data(tmp_path / "tasks")))
    result = cli_in_process("train", run, "--no-live", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6] and all("task_piqa_acc" in r for r in evals)
    # Every graph is compiled by the end of the first evaluation; the two evaluations after it compile nothing.
    assert compiled_at and max(compiled_at) <= evals[0]["time"] + 0.001, (compiled_at, evals[0]["time"])
    summary = json.loads(result.stdout)
    eval_phase = summary["time"]["phases"]["eval"]["seconds"]
    assert eval_phase >= sum(r["downstream_s"] for r in evals) > 0
