"""Linear layers computed from bf16 copies of their weights, made once per optimizer step instead of once per
micro-batch.

Under autocast each micro-batch casts every fp32 weight to bf16 for its forward GEMM (compiled, once more in
backward, where Inductor recomputes the cast rather than keep it), and each micro-batch's weight gradient leaves its
GEMM in bf16, to be cast to fp32 by a kernel of its own before it is added into `.grad`. With copies, the forward
reads a bf16 copy of the weights that the trainer refreshes before each step's first micro-batch
(nanopt.train.precision.weight_copies), and backward forms the weight gradient in fp32 straight out of the GEMM
where torch and the device can (CUDA: nanopt.model.gemm); elsewhere (the CPU) it is the bf16 product cast to fp32,
exactly autocast's numbers. Input and bias gradients are autocast's too. What is saved, per micro-batch and weight:
the cast in forward (and its recomputation), and the separate cast of the weight gradient; the add into `.grad`
stays, so the data-parallel wrappers' gradient hooks fire as they always did.

A group of layers that read the same input (q, k and v; gate and up) shares one copy, its layers' rows one after
another, so the stacked group (nanopt.model.stacked) runs its one GEMM on the copy as it lies: no concatenation per
micro-batch.

Only training forwards (gradients on, the module in train mode) read the copies. After a step's update they are one
update behind until the next step refreshes them, so an evaluation between steps computes from the fp32 weights, as
autocast always did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nanopt.model.gemm import gemm_writes_fp32
from nanopt.model.stacked import output_widths, stacked_bias


@torch.library.custom_op("nanopt::weight_grad_fp32", mutates_args=())
def weight_grad_fp32(grad_output: Tensor, inputs: Tensor) -> Tensor:
    """grad_output [rows, out] transposed times inputs [rows, in], as fp32 [out, in]: written in fp32 by the GEMM
    where it can, else the product in the operands' dtype cast to fp32. Opaque to torch.compile, so the fp32-output
    GEMM is the one that runs whatever Inductor's version lowers."""
    if gemm_writes_fp32(grad_output.device, grad_output.dtype):
        return torch.mm(grad_output.t(), inputs, out_dtype=torch.float32)
    return (grad_output.t() @ inputs).float()


@weight_grad_fp32.register_fake
def _(grad_output: Tensor, inputs: Tensor) -> Tensor:
    return grad_output.new_empty((grad_output.shape[1], inputs.shape[1]), dtype=torch.float32)


class _CopiedLinear(torch.autograd.Function):
    """F.linear(x, copy, bias) whose gradient goes to `weights` (the fp32 Parameters `copy` was made from, its rows
    one after another), in fp32, instead of to the copy."""

    @staticmethod
    def forward(ctx, x: Tensor, copy: Tensor, bias: Tensor | None, *weights: Tensor) -> Tensor:
        ctx.save_for_backward(x, copy)
        ctx.rows = [weight.shape[0] for weight in weights]
        return F.linear(x, copy, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, copy = ctx.saved_tensors
        grad_x = grad @ copy if ctx.needs_input_grad[0] else None
        grad_rows, x_rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_bias = grad_rows.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, *weight_grad_fp32(grad_rows, x_rows).split(ctx.rows)


def copied_linear(x: Tensor, layers: tuple[nn.Linear, ...], copy: Tensor, stacked: bool) -> tuple[Tensor, ...]:
    """Each layer's output for x, computed from `copy` (the layers' weights in bf16, their rows one after another):
    one GEMM over the whole copy when `stacked`, else one per layer over its rows. x is cast once per GEMM, as
    autocast casts it, so the layers' input gradients are summed in fp32 as autocast's are."""
    if stacked:
        bias = stacked_bias(layers)
        bias = None if bias is None else bias.to(copy.dtype)
        out = _CopiedLinear.apply(x.to(copy.dtype), copy, bias, *(layer.weight for layer in layers))
        return out.split(output_widths(layers), dim=-1)
    return tuple(_CopiedLinear.apply(x.to(copy.dtype), rows, None if layer.bias is None else layer.bias.to(copy.dtype),
                                     layer.weight)
                 for layer, rows in zip(layers, copy.split(output_widths(layers)), strict=True))


class WeightCopies:
    """The bf16 copies a model's Projections compute from in training: `refresh()` fills them from the fp32 weights,
    before each step's first micro-batch (and so after any load, rollback or update between steps)."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        self.copies = [copy for copy, _ in pairs]
        self.weights = [weight for _, weight in pairs]

    @torch.no_grad()
    def refresh(self) -> None:
        if self.copies:
            torch._foreach_copy_(self.copies, self.weights)

    @property
    def nbytes(self) -> int:
        return sum(copy.numel() * copy.element_size() for copy in self.copies)
