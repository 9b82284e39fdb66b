"""fp16 mixed precision's dynamic loss scaling (train.json "precision": "fp16", or "auto" on a GPU without bf16:
T4, V100), with torch's own torch.amp.GradScaler.

The loss is multiplied by the scale before backward and the gradients divided by it before clipping; a step whose
gradients overflowed is skipped (counted with the other non-finite steps, nanopt.train.step) and the scale halved,
and after `growth_interval` good steps in a row it doubles. Whether a step is skipped is decided from values every
rank agreed on, so every rank also lowers its scale: under FSDP2 a rank sees only its own gradient shards, and
GradScaler alone would let the ranks' scales drift apart.

The scale and the count of good steps since it last changed are part of the checkpoint (meta.json's
`loss_scale`), so a resumed run scales exactly as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch

from nanopt.runtime import Runtime


def new_scaler(rt: Runtime) -> torch.amp.GradScaler | None:
    """A GradScaler for an fp16 run (CUDA: nanopt.runtime refuses fp16 on the CPU), None otherwise."""
    return torch.amp.GradScaler(rt.device.type) if rt.precision == "fp16" else None


def scaled(scaler: torch.amp.GradScaler | None, loss: torch.Tensor) -> torch.Tensor:
    return loss if scaler is None else scaler.scale(loss)


def unscale(scaler: torch.amp.GradScaler | None, optimizers: list[Any]) -> None:
    """Divide every gradient by the scale (before clipping and the finiteness check)."""
    if scaler is not None:
        for optimizer in optimizers:
            scaler.unscale_(optimizer)


def update(scaler: torch.amp.GradScaler | None, skipped: bool) -> None:
    """After the step (or its skip) every rank agreed on: a skipped step lowers the scale on every rank."""
    if scaler is None:
        return
    if skipped:  # GradScaler reads overflow from what unscale_ found on this rank; make it the ranks' verdict
        for state in scaler._per_optimizer_states.values():
            for found in state["found_inf_per_device"].values():
                found.fill_(1.0)
    scaler.update()


def scaler_state(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    state = scaler.state_dict()
    return {"scale": float(state["scale"]), "growth_tracker": int(state["_growth_tracker"])}


def load_scaler_state(scaler: torch.amp.GradScaler, saved: dict[str, Any]) -> None:
    scaler.load_state_dict({**scaler.state_dict(), "scale": saved["scale"], "_growth_tracker": saved["growth_tracker"]})
