"""On CUDA the caching allocator grows expandable segments (less fragmentation, so the reserved peak nanopt reports
stays near what is allocated), unless the person set allocator options of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from clihelp import REPO

from nanopt.runtime import allocator_settings


def test_expandable_segments_unless_the_person_chose_their_own():
    assert allocator_settings({}) == "expandable_segments:True"
    assert allocator_settings({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}) is None
    assert allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}) is None
    assert allocator_settings({"PYTORCH_ALLOC_CONF": ""}) == "expandable_segments:True"  # empty: nothing chosen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("env", "expandable"), [({}, True), ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
                                                               False)])
def test_training_runtime_allocates_expandable_segments(env: dict, expandable: bool):
    code = ("import torch; from nanopt.runtime import init_runtime; init_runtime('bf16'); "
            "x = torch.ones(1 << 20, device='cuda'); "
            "print(all(s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']))")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, **env}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == str(expandable)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_counts_what_the_device_lost_outside_the_allocator():
    # cuBLAS and cuDNN take handles, workspaces and kernels outside the caching allocator on first use, after the
    # probe measured the CUDA context: the peak must still cover all the device has lost, read as the driver does.
    from nanopt.devices import MemoryProbe

    device = torch.device("cuda", torch.cuda.current_device())
    probe = MemoryProbe(device)
    probe.reset()
    x = torch.randn(512, 512, device=device)
    image = torch.randn(2, 3, 64, 64, device=device)
    (x @ x).sum().item()
    torch.nn.functional.conv2d(image, torch.randn(8, 3, 3, 3, device=device)).sum().item()
    free, total = torch.cuda.mem_get_info(device)
    assert probe.peak() >= total - free
