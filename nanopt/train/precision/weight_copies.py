"""train.json "bf16_weight_copies": the blocks' linear layers train from bf16 copies of their weights made once per
optimizer step (nanopt.model.weight_copies), instead of autocast's cast of every fp32 weight on every micro-batch.

What it saves, per micro-batch and weight: the forward's cast (and, compiled, its recomputation in backward) and the
cast of the bf16 weight gradient to fp32, which the GEMM writes in fp32 itself where torch and the GPU can. What it
costs: the copies, 2 bytes per weight of the blocks, kept for the run (the memory model counts them), and one copy
kernel per step. On the CPU the numbers are autocast's exactly; on a GPU the weight gradients skip one rounding to
bf16. Off until a GPU window measures it (bench/gpusession, the "copies" steps).

Refused in one line outside bf16 and under FSDP2 with more than one rank: FSDP2 gathers each block's weights in bf16
per micro-batch by its own mixed-precision policy, and the copies would be the sharded weights' (nanopt.train.parallel
.wrap). On one process every parallelism trains as DDP's, so the copies apply there.
"""

from __future__ import annotations

import torch

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.model.weight_copies import WeightCopies


def check_bf16_weight_copies(run: RunConfig, precision: str, sharded: bool, world_size: int) -> None:
    """ConfigError, one line, when train.json's bf16_weight_copies cannot apply; nothing when it is off. `sharded`:
    the run's parallelism is FSDP2's over more than one rank (nanopt.train.parallel.wrap)."""
    train = run.train
    if not train.bf16_weight_copies:
        return
    where = f"{run.run_dir / 'train.json'}: key 'bf16_weight_copies': true"
    off = "set \"bf16_weight_copies\": false"
    if precision != "bf16":
        raise ConfigError(f"{where} needs \"precision\": \"bf16\" (the copies are what the bf16 GEMMs read); this run "
                          f"computes in {precision}", f"set \"precision\": \"bf16\" (or \"auto\" on a GPU with bf16), "
                                                      f"or {off}")
    if sharded:
        raise ConfigError(f"{where} does not combine with \"parallelism\": \"{train.parallelism}\" over {world_size} "
                          "ranks (FSDP2 gathers each block's weights in bf16 itself, every micro-batch)",
                          f"set \"parallelism\": \"ddp\" or \"zero1\", or {off}")


def keep_weight_copies(model: torch.nn.Module, on: bool, dtype: torch.dtype | None) -> WeightCopies | None:
    """The model's weight copies when the setting is on (after FP8's layers are in place: they keep their own
    GEMMs), else None. Checked before (check_bf16_weight_copies), so `dtype` is bf16 when on."""
    if not on or dtype is None:
        return None
    return model.keep_weight_copies(dtype)
