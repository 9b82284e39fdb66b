"""A training step that runs out of memory: one line with what to change, exit 2, no traceback, and the checkpoint
whose background save was in flight published first (nanopt.train.guard.oom).

The step is made to fail from the outside (the run's own `step`, wrapped), with torch's own errors: its CUDA
OutOfMemoryError, and a real refusal of the CPU allocator. A CUDA device cannot be exhausted on purpose here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from clihelp import assert_user_error
from faulthelp import tiny_run

import nanopt.train.loop
from nanopt.train import checkpoint as ckpt


def cuda_out_of_memory() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "79.19 GiB of which 1.06 GiB is free.\nOf the allocated memory ...")


def cpu_out_of_memory() -> None:
    torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB: the CPU allocator refuses at once ("can't allocate memory")


@pytest.mark.parametrize("fail", [cuda_out_of_memory, cpu_out_of_memory])
def test_out_of_memory_in_a_step_is_one_line_after_the_save_in_flight(tmp_path: Path, tiny_dataset: Path,
                                                                      cli_in_process, monkeypatch, fail):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=10)  # a checkpoint every 2 steps, written in the background
    real_step = nanopt.train.loop.step

    def step(session):
        if session.state.step == 4:  # step 5; step 4's checkpoint is being written
            fail()
        return real_step(session)

    monkeypatch.setattr(nanopt.train.loop, "step", step)
    result = cli_in_process("train", run, "--no-live")
    # The steps' log lines come first on stderr; then the error, as one line.
    error = result.stderr.strip().splitlines()[-1]
    assert_user_error(SimpleNamespace(returncode=result.returncode, stderr=error), "out of memory on",
                      "at step 5", "micro_batch_size", "find-batch", "activation_checkpointing",
                      "latest: step-000004", "--allow-changed")
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
    assert ckpt.read_pointer(run / "checkpoints", "latest") == "step-000004"
    assert (run / "checkpoints" / "step-000004" / "meta.json").is_file()
