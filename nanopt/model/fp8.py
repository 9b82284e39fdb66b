"""FP8 matmuls of the output head, with per-tensor dynamic scaling: torch only, no library, so it lives with the model.

A tensor goes to FP8 as round(x * scale) in float8, scale = the format's largest value / amax(|x|), so its largest
entry lands at the top of the format's range; a product of two such tensors is divided by both scales. Forward
operands (activations, weights) use e4m3 (more mantissa); gradients use e5m2 (more range), the split of the FP8
training recipes (NVIDIA Transformer Engine's "hybrid", modded-nanogpt's head, torchao).

Two ways to run the product, which agree up to the order of fp32 additions:
- "scaled_mm": torch._scaled_mm on FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell). The scales
  are tensors, never Python numbers, so torch.compile traces it without a device sync.
- "emulate": the same FP8 values (exact in fp32) multiplied in fp32, then divided by the scales. Runs anywhere, and
  is how the CPU tests compare the FP8 head with bf16 and fp32; slower than fp32 itself, so not a training mode.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

HeadMode = Literal["scaled_mm", "emulate"]
FORWARD_DTYPE = torch.float8_e4m3fn
GRADIENT_DTYPE = torch.float8_e5m2
MIN_AMAX = 1e-12  # an all-zero tensor gets a finite scale (its FP8 values are zero whatever the scale)
SCALED_MM_ALIGN = 16  # torch._scaled_mm needs every dimension a multiple of 16


def to_fp8(tensor: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(tensor in `dtype`, its fp32 scalar scale): tensor ~= fp8 / scale. Values are clamped to the format's range
    first, because a cast past the largest e4m3fn value gives NaN rather than saturating."""
    largest = torch.finfo(dtype).max
    amax = tensor.detach().abs().amax().float().clamp(min=MIN_AMAX)
    scale = largest / amax
    return (tensor.float() * scale).clamp(-largest, largest).to(dtype), scale


def scaled_matmul(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, out_dtype: torch.dtype,
                  mode: HeadMode) -> Tensor:
    """(a / a_scale) @ (b / b_scale) in out_dtype, a [M, K] and b [K, N] FP8. For "scaled_mm" a is row-major and
    b column-major (the transpose of a contiguous [N, K] tensor), as cuBLAS's FP8 GEMM takes them."""
    if mode == "emulate":
        return (a.float() @ b.float()).div_(a_scale * b_scale).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


class Fp8HeadOperands:
    """The loss's head weight [V, C] and hidden states [N, C], each cast to e4m3 once per loss call with one scale,
    in the layouts its three GEMMs take: logits = hidden @ weight.T (forward), d(hidden) = d(logits) @ weight and
    d(weight) = d(logits).T @ hidden (both formed in the loss's forward pass, nanopt.model.loss). d(logits) is cast
    to e5m2 per chunk, with the chunk's own scale."""

    def __init__(self, hidden: Tensor, weight: Tensor, mode: HeadMode) -> None:
        self.mode = mode
        self.hidden, self.hidden_scale = to_fp8(hidden, FORWARD_DTYPE)
        self.weight, self.weight_scale = to_fp8(weight, FORWARD_DTYPE)
        self.weight_by_column = self.weight.t().contiguous().t()  # [V, C] column-major: the B of d(hidden)

    def logits(self, rows: slice, out_dtype: torch.dtype) -> Tensor:
        return scaled_matmul(self.hidden[rows], self.hidden_scale, self.weight.t(), self.weight_scale, out_dtype,
                             self.mode)

    def grad_hidden(self, grad: tuple[Tensor, Tensor], out_dtype: torch.dtype) -> Tensor:
        """d(hidden) of a chunk from its d(logits) as `to_fp8(d_logits, GRADIENT_DTYPE)` gives it."""
        grad, grad_scale = grad
        return scaled_matmul(grad, grad_scale, self.weight_by_column, self.weight_scale, out_dtype, self.mode)

    def accumulate_grad_weight(self, accumulator: Tensor, grad: tuple[Tensor, Tensor], rows: slice) -> None:
        """accumulator += d(weight) of the chunk `rows`, from its d(logits) in FP8 as for grad_hidden."""
        grad, grad_scale = grad
        # A = d(logits).T row-major (one copy of the 1-byte chunk), B = hidden chunk column-major (likewise).
        hidden_by_column = self.hidden[rows].t().contiguous().t()
        accumulate_fp8_product(accumulator, grad.t().contiguous(), grad_scale, hidden_by_column, self.hidden_scale,
                               self.mode == "emulate")


@torch.library.custom_op("nanopt::accumulate_fp8_product", mutates_args=("accumulator",))
def accumulate_fp8_product(accumulator: Tensor, a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                           emulate: bool) -> None:
    """accumulator (fp32) += (a / a_scale) @ (b / b_scale), in place. Opaque to torch.compile for the reason given
    at nanopt.model.loss.accumulate_head_grad: traced, the per-chunk adds become one fused add at the end that keeps
    every chunk's [V, C] product alive."""
    accumulator.add_(scaled_matmul(a, a_scale, b, b_scale, torch.float32, "emulate" if emulate else "scaled_mm"))


def head_fits_scaled_mm(rows: int, hidden_size: int, vocab_size: int) -> bool:
    """Whether every GEMM dimension of the FP8 head is a multiple of 16 (torch._scaled_mm's requirement); the loss
    chunks are multiples of 128 rows (nanopt.model.loss_chunks), so the micro-batch's rows decide the last one."""
    return all(n % SCALED_MM_ALIGN == 0 for n in (rows, hidden_size, vocab_size))
