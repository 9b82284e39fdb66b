"""The training step waits for the device once per optimizer step: one read of one tensor that holds the mean loss,
the skip and stop flags and the grad norm; never an `.item()` / `float(tensor)` of its own, on a good step or a
skipped non-finite one; and the grad norm it returns is the one the clip computed."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import pytest
import torch
from faulthelp import tiny_run
from torch.utils._python_dispatch import TorchDispatchMode

from nanopt.config import load_run
from nanopt.runtime import init_runtime
from nanopt.train.session import build_session
from nanopt.train.step import step


class ScalarReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (`.item()`, `float(t)`, `bool(t)`: aten's
    _local_scalar_dense, a device-to-host sync on a GPU). The optimizer's own step counters are host tensors that
    never touch the device (AdamW reads them as numbers): those are left out."""

    def __init__(self, host_counters: set[int]) -> None:
        super().__init__()
        self.host_counters = host_counters
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.host_counters:
            self.reads.append(f"{args[0].shape} {args[0].dtype}")
        return func(*args, **(kwargs or {}))


def _session(tmp_path: Path, tiny_dataset: Path, **train):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=10, eval_interval=0, **train)
    return build_session(load_run(run), init_runtime("fp32"))


def _step_counters(session) -> set[int]:
    return {id(state["step"]) for state in session.optimizer.state.values() if "step" in state}


def test_a_step_never_reads_a_tensor_by_item_on_a_good_or_a_skipped_step(tmp_path: Path, tiny_dataset: Path):
    s = _session(tmp_path, tiny_dataset)
    step(s)  # the optimizer's state exists from here on
    reads = ScalarReads(_step_counters(s))
    with reads:
        loss, norm, stop = step(s)
    assert math.isfinite(loss) and math.isfinite(norm) and not stop
    assert reads.reads == [], reads.reads
    # A non-finite step is decided and reported from the same single read.
    with torch.no_grad():
        next(s.prepared.raw.parameters()).fill_(float("nan"))
    reads = ScalarReads(_step_counters(s))
    with reads:
        loss, norm, stop = step(s)
    assert math.isnan(loss) and s.state.skipped_steps == 1 and s.state.consecutive_nonfinite == 1
    assert reads.reads == [], reads.reads


def test_the_grad_norm_returned_is_the_clips_and_the_preemption_flag_comes_through(tmp_path: Path,
                                                                                  tiny_dataset: Path):
    s = _session(tmp_path, tiny_dataset, grad_clip=0.5)
    # The same step by hand, on a copy of the model and of the loader: the norm of the gradients it clipped.
    model, loader = copy.deepcopy(s.prepared.raw), copy.deepcopy(s.loader)
    for _ in range(s.accum):
        inputs, targets = loader.next_batch()
        (model(inputs, targets) / s.accum).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    s.preempt_requested = True
    loss, norm, stop = step(s)
    assert norm == pytest.approx(expected, rel=1e-6) and expected > 0.5  # clipped, and reported before clipping
    assert stop is True and math.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_synchronizing_operation_per_step_on_a_gpu(tmp_path: Path, tiny_dataset: Path):
    s = _session(tmp_path, tiny_dataset)
    assert s.rt.device.type == "cuda"
    step(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
