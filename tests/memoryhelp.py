"""Memory tests' measurement: the bytes a model's blocks keep for backward, counted from the tensors themselves."""

from __future__ import annotations

import torch


def saved_by_blocks(model: torch.nn.Module, batch: torch.Tensor, autocast: torch.dtype | None = None) -> int:
    """Bytes the transformer blocks keep for backward in one forward pass: the distinct storages handed to autograd's
    saved-tensor hooks while a block runs (a checkpointed block's input included: torch saves it through them),
    and what selective checkpointing's cache holds (torch keeps that outside the hooks, so its caching mode is
    watched), weights excluded. `autocast`: run the forward under CPU autocast to that dtype (the casts a GPU run
    makes)."""
    import torch.utils.checkpoint as torch_checkpoint

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = []

    def note(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if inside and storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        note(tensor)
        return tensor

    caching = torch_checkpoint._CachingTorchDispatchMode
    original = caching.__torch_dispatch__

    def watched(self, func, types, args=(), kwargs=None):
        out = original(self, func, types, args, kwargs)
        policy = self.policy_fn(torch_checkpoint.SelectiveCheckpointContext(is_recompute=False), func, *args)
        if policy == torch_checkpoint.CheckpointPolicy.MUST_SAVE:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(tensor):
                    note(tensor)
        return out

    def enter(*_) -> None:
        inside.append(True)

    def leave(*_) -> None:
        inside.pop()

    for block in model.layers:
        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    caching.__torch_dispatch__ = watched
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
                torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            model(batch[:, :-1], batch[:, 1:])
    finally:
        caching.__torch_dispatch__ = original
    return sum(saved.values())
