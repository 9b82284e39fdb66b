"""torch.optim.Muon's step with the matrices of one shape orthogonalized together.

torch's own step (torch.optim._muon._single_tensor_muon) walks the matrices one at a time, and each costs about 25
kernel launches: the momentum, a bf16 copy and its norm, five Newton-Schulz iterations of three matmuls, the weight
decay and the update. GPT-2 small has 48 such matrices in four shapes: some 1,200 launches a step for about 1.2
TFLOP of arithmetic (2 ms on an H100), so the launches, not the arithmetic, set the step's time (0.73x AdamW's
tokens/s measured with torch's step; bench/RESULTS.md). Here the matrices of one shape go through the iteration as
one batch (torch.baddbmm), and the elementwise parts run as foreach operations over every matrix. That is the same
arithmetic in the same precision with about a tenth of the launches. The state (torch's `momentum_buffer` per
parameter) and the parameter groups are torch's, so checkpoints, resumes and DCP's state dicts do not change.
"""

from __future__ import annotations

from typing import Any

import torch

# The Muon settings the batched iteration reads from a parameter group (torch 2.9 and later name them so).
_SETTINGS = frozenset({"momentum", "nesterov", "weight_decay", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn"})
# At most this many elements of a shape go through one batch (128 MiB in bf16). The batch's intermediates are a few
# times its size, and a 1B model has 48 matrices of 2048 x 8192: all at once would be about 5 GiB outside what the
# memory model counts, while 4 at a time keep most of the saving.
BATCH_ELEMENTS = 1 << 26


def batched_step_supported(muon: torch.optim.Optimizer) -> bool:
    """Whether this torch's Muon has what batched_muon_step relies on (else its own step is used)."""
    try:
        from torch.optim._muon import _adjust_lr  # noqa: F401 - private to torch: asked for, not assumed
    except ImportError:
        return False
    return hasattr(muon, "_init_group") and _SETTINGS <= set(muon.defaults)


@torch.no_grad()
def batched_muon_step(muon: torch.optim.Optimizer) -> None:
    """One step of `muon` (a torch.optim.Muon whose parameters are whole matrices), batched by shape."""
    from torch.optim._muon import _adjust_lr

    # The label torch's own Optimizer.step carries: nanopt profile counts everything inside it as the optimizer's.
    with torch.profiler.record_function(f"Optimizer.step#{type(muon).__name__}.step"):
        for group in muon.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor] = []
            muon._init_group(group, params, grads, buffers)  # creates missing momentum buffers as torch's step does
            if params:
                _group_step(group, params, grads, buffers, _adjust_lr)


def _group_step(group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                buffers: list[torch.Tensor], adjust_lr: Any) -> None:
    """torch's per-parameter loop for one group, in its order: momentum, orthogonalization, decay, update."""
    momentum = group["momentum"]
    torch._foreach_lerp_(buffers, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
    lr = float(group["lr"])
    torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
    for batch in _batches(params):
        orthogonalized = orthogonalize(torch.stack([updates[i].bfloat16() for i in batch]), group)
        step = adjust_lr(lr, group["adjust_lr_fn"], params[batch[0]].shape)
        # In the weights' dtype: foreach's one-launch path wants one dtype, and bf16 -> fp32 is exact, so the sum is
        # the one torch's `param.add_(bf16 update)` forms.
        torch._foreach_add_([params[i] for i in batch], list(orthogonalized.to(params[batch[0]].dtype).unbind(0)),
                            alpha=-step)


def indices_by_shape(params: list[torch.Tensor]) -> dict[tuple[int, ...], list[int]]:
    """The indices of `params` grouped by shape, in first-seen order (every rank walks them alike)."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for index, param in enumerate(params):
        by_shape.setdefault(tuple(param.shape), []).append(index)
    return by_shape


def _batches(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `params` by shape, in batches of at most BATCH_ELEMENTS elements (at least one matrix each)."""
    batches = []
    for shape, indices in indices_by_shape(params).items():
        size = max(1, BATCH_ELEMENTS // max(1, shape[0] * shape[1]))
        batches += [indices[start:start + size] for start in range(0, len(indices), size)]
    return batches


def orthogonalize(updates: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch's quintic Newton-Schulz iteration (torch.optim._muon._zeropower_via_newtonschulz: each matrix scaled
    to a spectral norm of at most 1 by its Frobenius norm, worked on wide, in bf16) on a batch [n, rows, cols]."""
    a, b, c = group["ns_coefficients"]
    x = updates.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=group["eps"])
    for _ in range(group["ns_steps"]):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x
