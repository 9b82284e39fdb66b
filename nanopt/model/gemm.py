"""GEMMs of bf16 (or fp16) operands that write fp32: where a gradient is accumulated in fp32, the product leaves the
GEMM in fp32 instead of being rounded to the operands' dtype and cast back up by a kernel of its own."""

from __future__ import annotations

import functools

import torch


@functools.cache
def gemm_writes_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch and device run mm and addmm with `dtype` operands and out_dtype=float32 (newer torch, CUDA):
    tried once on a tiny problem, so an older build or an unsupported device keeps the plain path. The CPU has no
    such kernel."""
    if device.type != "cuda" or "dtype_out" not in torch.ops.aten.addmm.overloads():
        return False
    accumulator = torch.ones(16, 16, device=device)
    operand = torch.ones(16, 16, device=device, dtype=dtype)
    try:
        torch.addmm(accumulator, operand, operand, out_dtype=torch.float32, out=accumulator)
        product = torch.mm(operand, operand, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((accumulator == 17).all()) and product.dtype == torch.float32
