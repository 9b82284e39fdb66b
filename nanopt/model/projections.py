"""The modules of a block whose linear layers form groups that read one input (q, k and v; gate and up): how each
group is computed, from one place, whichever way the model was told to (Transformer.stack_projections,
Transformer.keep_weight_copies)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nanopt.model.stacked import output_widths, project, stackable
from nanopt.model.weight_copies import copied_linear


class Projections(nn.Module):
    """A module whose linear layers form named groups, each group's layers reading one input (GROUPS): the unit a
    stacked GEMM (`stacked`) and a weight copy (keep_copies) cover."""

    GROUPS: dict[str, tuple[str, ...]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.stacked = False  # each group in one GEMM (Transformer.stack_projections)

    def project(self, group: str, x: Tensor) -> tuple[Tensor, ...]:
        """The outputs of the group's layers for x: from the group's copy in a training forward when one is kept,
        else from the weights themselves (stacked as asked: nanopt.model.stacked)."""
        layers = tuple(getattr(self, name) for name in self.GROUPS[group])
        stacked = self.stacked and len(layers) > 1
        copy = getattr(self, _copy_name(group), None)
        if copy is not None and self.training and torch.is_grad_enabled():
            return copied_linear(x, layers, copy, stacked)
        return project(x, layers, stacked)

    def keep_copies(self, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
        """Give each group of plain nn.Linear layers a copy of its weights in `dtype` (a buffer outside the state
        dict, unfilled); returns (copy rows, weight) pairs for WeightCopies to fill. A group holding another kind of
        layer (torchao's Float8Linear) runs its own GEMMs and gets none."""
        pairs = []
        for group, names in self.GROUPS.items():
            layers = tuple(getattr(self, name) for name in names)
            if not stackable(layers):
                continue
            copy = torch.empty(sum(output_widths(layers)), layers[0].in_features, dtype=dtype,
                               device=layers[0].weight.device)
            self.register_buffer(_copy_name(group), copy, persistent=False)
            pairs += zip(copy.split(output_widths(layers)), (layer.weight for layer in layers), strict=True)
        return pairs


def _copy_name(group: str) -> str:
    return f"{group}_weight_copy"
