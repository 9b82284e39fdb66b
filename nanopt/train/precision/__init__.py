"""Numerics of training beyond the model's own arithmetic: FP8 training's side (fp8; the FP8 GEMMs themselves are
nanopt.model.fp8), fp16's dynamic loss scaling (scaling), the bf16 residual stream (residual) and the bf16 weight copies
(weight_copies)."""
