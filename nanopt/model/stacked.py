"""Stacked projections: linear layers that read the same input (q, k and v; SwiGLU's gate and up) computed as one GEMM.

The layers keep their own Parameters, so parameter names, state-dict keys, checkpoints, export, import, FSDP2's
sharding and every optimizer see exactly what they see unstacked: the weights are concatenated at each forward,
and the product split back into each layer's columns.

Why one GEMM: on GPT-2 small each q, k, v weight gradient is a 768 x 768 output, too few tiles for a large GPU, so
cuBLAS splits the long token dimension instead (split-K), and the three input gradients are summed afterwards. One
[2304, 768] product fills three times the tiles and forms the input gradient in one GEMM, as the fused c_attn of
nanoGPT-style baselines does.

What it costs: the concatenated weights, which the GEMM keeps for backward. Under autocast their cast takes the
place of the layers' own casts (the same bytes); where nothing casts the weights (fp32, or FSDP2's gathered bf16
weights) they are a copy the separate layers do not make, one per block that is not checkpointed, eager or compiled
(nanopt.model.memory.weight_copy_bytes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def stackable(layers: tuple[nn.Linear, ...]) -> bool:
    """Whether the layers are plain nn.Linear, all with biases or all without, so one F.linear computes what their
    own forwards would. A subclass (torchao's Float8Linear, from train.json's fp8 "all") runs its own GEMM: the group
    then runs unstacked, and each layer keeps its FP8 GEMM."""
    with_bias = layers[0].bias is not None
    return all(type(layer) is nn.Linear and (layer.bias is not None) == with_bias for layer in layers)


def stacked_bias(layers: tuple[nn.Linear, ...]) -> Tensor | None:
    """The layers' biases one after another (None: the layers have none)."""
    return None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])


def output_widths(layers: tuple[nn.Linear, ...]) -> list[int]:
    """Each layer's share of the stacked output's columns (and of the stacked weight's rows)."""
    return [layer.out_features for layer in layers]


def stacked_linear(x: Tensor, layers: tuple[nn.Linear, ...]) -> tuple[Tensor, ...]:
    """Each layer's output for x, from one GEMM over the layers' concatenated weights (and biases)."""
    weight = torch.cat([layer.weight for layer in layers])
    return F.linear(x, weight, stacked_bias(layers)).split(output_widths(layers), dim=-1)


def project(x: Tensor, layers: tuple[nn.Linear, ...], stacked: bool) -> tuple[Tensor, ...]:
    """The layers' outputs for x: stacked when asked and the layers allow it (stackable), else one GEMM each."""
    if stacked and stackable(layers):
        return stacked_linear(x, layers)
    return tuple(layer(x) for layer in layers)
