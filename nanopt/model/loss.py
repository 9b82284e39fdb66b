"""The training loss: cross-entropy of the output layer, fused with it and worked through row chunks, so no
[tokens, vocab] fp32 logits are ever kept (nanopt.model.loss_chunks decides the chunks; the memory model counts
what this holds). Pure: tensors in, a loss and its gradients out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nanopt.model.fp8 import GRADIENT_DTYPE, Fp8HeadOperands, HeadMode, to_fp8
from nanopt.model.gemm import gemm_writes_fp32
from nanopt.model.loss_chunks import loss_chunk_rows

IGNORE_INDEX = -100


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor, classes: int) -> Tensor:
    logits = F.linear(hidden, weight)[:, :classes]  # in the autocast dtype when autocast is on
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropy of `hidden @ weight.T`, with both gradients computed chunk by chunk in forward.

    For each chunk of rows the fp32 logits live only long enough to give the loss and their gradient
    (softmax - one_hot), which is immediately multiplied into d(hidden) and accumulated into the fp32 d(weight).
    Backward only scales what forward stored: no [rows, vocab] tensor is kept and nothing is recomputed, so the
    FLOPs equal those of a plain full-logits loss while memory holds one chunk of logits.

    `weight` comes in its own dtype (fp32 master weights under autocast) and is cast to the hidden states' dtype for
    the GEMMs here, so d(weight) reaches the weight in that dtype as it was accumulated: an fp32 weight's gradient
    is never rounded to bf16 on its way to `.grad`, as it would be through an autograd cast outside.

    With `fp8` the three GEMMs run in FP8 (nanopt.model.fp8): e4m3 hidden states and weight in the logits, e5m2
    d(logits) against them in the two gradients; the softmax and the accumulated d(weight) stay fp32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int, classes: int,
                fp8: HeadMode | None = None) -> Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        weight = weight.to(hidden.dtype)  # the GEMMs' operand; the fp32 weight's gradient is returned unrounded
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        total = hidden.new_zeros((), dtype=torch.float32)
        operands = Fp8HeadOperands(hidden, weight, fp8) if fp8 is not None else None
        for begin in range(0, hidden.shape[0], chunk_rows):
            rows = slice(begin, begin + chunk_rows)
            logits = hidden[rows] @ weight.t() if operands is None else operands.logits(rows, hidden.dtype)
            chunk_loss, grad_logits = _chunk_loss_and_grad(logits, targets[rows], classes, hidden.dtype)
            total = total + chunk_loss
            if operands is not None:  # one e5m2 cast of d(logits) serves both gradients
                _fp8_chunk_grads(operands, to_fp8(grad_logits, GRADIENT_DTYPE), rows, grad_hidden, grad_weight)
                continue
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                accumulate_head_grad(grad_weight, grad_logits.t(), hidden[rows])
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        # The stored gradients are scaled in place: a second [V, C] fp32 head gradient at the loss's backward, when
        # every activation is still alive, would be the step's memory peak. So they serve one backward only.
        if getattr(ctx, "spent", False):
            raise RuntimeError("chunked cross-entropy: backward through the same loss twice (retain_graph) is not "
                               "supported; compute the loss again")
        ctx.spent = True
        grad_hidden, grad_weight = ctx.saved_tensors
        d_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype)) if grad_hidden is not None else None
        d_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype) if grad_weight is not None else None
        return d_hidden, d_weight, None, None, None, None


def _fp8_chunk_grads(operands: Fp8HeadOperands, grad: tuple[Tensor, Tensor], rows: slice,
                     grad_hidden: Tensor | None, grad_weight: Tensor | None) -> None:
    if grad_hidden is not None:
        grad_hidden[rows] = operands.grad_hidden(grad, grad_hidden.dtype)
    if grad_weight is not None:
        operands.accumulate_grad_weight(grad_weight, grad, rows)


def _chunk_loss_and_grad(logits: Tensor, targets: Tensor, classes: int,
                         grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Summed loss of one chunk of logits and d(summed loss)/d(logits) in grad_dtype (the matmul dtype); ignored rows
    contribute 0, and so do the columns from `classes` on (padded vocabulary rows: their -inf logits have
    probability 0)."""
    logits = logits.float()
    if classes < logits.shape[1]:
        logits[:, classes:] = float("-inf")
    valid = targets != IGNORE_INDEX
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
    target_logits = logits.gather(1, safe_targets)
    loss = ((log_normalizer - target_logits).squeeze(1) * valid).sum()
    if torch.compiler.is_compiling():
        # One pure pointwise expression: Inductor fuses exp, the one-hot subtraction, the mask and the cast into a
        # single pass that reads the logits once and writes the matmul-dtype gradient (no fp32 buffer).
        is_target = torch.arange(logits.shape[1], device=logits.device) == safe_targets
        probabilities = (logits - log_normalizer).exp()
        grad = torch.where(is_target, probabilities - 1.0, probabilities) * valid.unsqueeze(1)
        return loss, grad.to(grad_dtype)
    # Eager runs op by op: in place on the logits' memory, so one fp32 chunk buffer is live, and the one-hot
    # subtraction touches one element per row.
    probabilities = logits.sub_(log_normalizer).exp_()
    probabilities.scatter_add_(1, safe_targets, -torch.ones_like(target_logits))
    probabilities.mul_(valid.unsqueeze(1))
    return loss, probabilities.to(grad_dtype)


@torch.library.custom_op("nanopt::accumulate_head_grad", mutates_args=("accumulator",))
def accumulate_head_grad(accumulator: Tensor, grad_logits_t: Tensor, hidden: Tensor) -> None:
    """accumulator (fp32 [V, C]) += grad_logits_t [V, rows] @ hidden [rows, C], in place.

    An opaque in-place op on purpose: traced as plain tensor code, torch.compile turns the per-chunk `+=` into a
    chain of out-of-place adds that Inductor fuses into one kernel at the end, which keeps every chunk's [V, C]
    product alive at once. Here each product is added as soon as it exists: inside the GEMM (beta = 1) for fp32
    operands, and for bf16/fp16 on CUDA where torch's addmm takes out_dtype=float32; else through one product.
    """
    if grad_logits_t.dtype == torch.float32:
        accumulator.addmm_(grad_logits_t, hidden)
    elif gemm_writes_fp32(accumulator.device, grad_logits_t.dtype):
        torch.addmm(accumulator, grad_logits_t, hidden, out_dtype=torch.float32, out=accumulator)
    else:
        accumulator.add_(grad_logits_t @ hidden)


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    device = tensor.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tensor.dtype


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_rows: int | None = None,
                          classes: int | None = None, fp8: HeadMode | None = None) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against targets, equal to F.cross_entropy on the full logits.

    hidden [N, C], weight [V, C], targets [N] with -100 ignored. `classes` (default V): only the first `classes`
    columns of the logits are classes; the rest (a vocabulary padded for aligned GEMMs) stay in the matmul but out
    of the softmax, and get no gradient. Works through chunks of `chunk_rows` rows (default:
    nanopt.model.loss_chunks.loss_chunk_rows), so peak memory holds one chunk of fp32 logits instead of N x V; with
    autograd the gradients are formed in the same pass (see _LinearCrossEntropy). One chunk (small logits) is the
    plain full-logits loss, left to autograd. Under autocast the matmuls run in the autocast dtype and the softmax
    in fp32. The loop bounds are shapes, so torch.compile sees static control flow. `fp8` (training only): the
    head's GEMMs in FP8, by torch._scaled_mm or its fp32 emulation (nanopt.model.fp8), even for one chunk;
    evaluation (no gradients) keeps the autocast dtype.
    """
    rows = hidden.shape[0]
    classes = weight.shape[0] if classes is None else classes
    if chunk_rows is None:
        chunk_rows = loss_chunk_rows(rows, weight.shape[0])
    differentiable = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if differentiable and (chunk_rows < rows or fp8 is not None):
        dtype = _compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            total = _LinearCrossEntropy.apply(hidden.to(dtype), weight, targets, chunk_rows, classes, fp8)
    else:  # evaluation, or logits small enough to keep whole: autograd differentiates F.cross_entropy
        total = hidden.new_zeros((), dtype=torch.float32)
        for begin in range(0, rows, chunk_rows):
            end = begin + chunk_rows
            total = total + _chunk_loss_sum(hidden[begin:end], weight, targets[begin:end], classes)
    # All targets ignored gives 0 / 0 = nan, exactly as F.cross_entropy's mean does.
    return total / (targets != IGNORE_INDEX).sum()
