"""The tensors a model config gives, learnt on the meta device without allocating them, and how a set of stored
tensors differs from them.

A checkpoint's config snapshot and its stored tensors may disagree (a damaged or crafted file): eval, export and
train compare names, shapes and dtypes here (nanopt.train.checkpoint.contents reads the stored side from file headers)
before they allocate a model, so a snapshot cannot ask for memory the files do not back.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping
from typing import NamedTuple

import torch

from nanopt.config import ModelConfig
from nanopt.model.transformer import Transformer


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: str | None = None  # "float32", ...; None: any dtype

    def matches(self, other: TensorSpec) -> bool:
        return self.shape == other.shape and (self.dtype is None or other.dtype is None or self.dtype == other.dtype)

    def __str__(self) -> str:
        return f"{self.dtype} {self.shape}" if self.dtype else f"{self.shape}"


@functools.lru_cache(maxsize=4)
def meta_model(cfg: ModelConfig) -> Transformer:
    """Transformer(cfg) on the meta device: every name, shape and dtype, and no memory. Cached (each checkpoint of a
    run has the same config): read it, never change it."""
    with torch.device("meta"):
        return Transformer(cfg)


def spec_of(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def tensor_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """{state_dict name: spec} of Transformer(cfg), tied names included."""
    return {name: spec_of(t) for name, t in meta_model(cfg).state_dict().items()}


def parameter_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """{name: spec} of the trainable parameters, each once (a tied head is its embedding): what optimizer state is
    kept for, under these names."""
    return {name: spec_of(p) for name, p in meta_model(cfg).named_parameters() if p.requires_grad}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for each parameter registered under a second name (tied input and output embeddings): a
    checkpoint stores it once."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def mismatch(expected: Mapping[str, TensorSpec], found: Mapping[str, TensorSpec],
             optional: Collection[str] = ()) -> str | None:
    """How `found` differs from `expected` (names missing or unexpected, else the first shape or dtype that
    differs), or None when they agree. Names in `optional` may be missing."""
    missing = sorted(set(expected) - set(found) - set(optional))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        return f"missing {few(missing)}, unexpected {few(unexpected)}"
    for key in sorted(set(expected) & set(found)):
        want, have = expected[key], found[key]
        if want.shape != have.shape:
            return f"{key} has shape {have.shape}, the model's {want.shape}"
        if not want.matches(have):
            return f"{key} is {have.dtype}, the model's {want.dtype}"
    return None


def few(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:4]) + (f" (+{len(keys) - 4} more)" if len(keys) > 4 else "")
