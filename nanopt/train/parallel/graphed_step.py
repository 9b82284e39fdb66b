"""train.json "cuda_graphs": the micro-step (forward and backward of one micro-batch) captured once as a CUDA graph
and replayed for every micro-batch, so the host launches one graph instead of hundreds of kernels.

Why: with a small model the GPU finishes a kernel before Python has launched the next, and the gaps between the
kernels of forward and backward add up to milliseconds per micro-batch. A replay launches them all at once.

What stays outside the graph: the copy of each micro-batch into the graph's input buffers, clipping, the
finite-loss agreement over ranks, the optimizer and evaluation; the gradients the graph accumulates are the
parameters' own `.grad` tensors. Built by hand rather than with torch.compile's mode="reduce-overhead", whose
cudagraph trees overwrite the outputs of one replay with the next and so break gradient accumulation.

Invariants a replay relies on, checked before each step (host-side identity checks, no device sync):
- every parameter's storage is the one captured (a rollback that loaded a checkpoint in place keeps it; a
  replaced tensor means capturing again);
- every `.grad` is the captured tensor: `zero_grad(set_to_none=True)` drops it, so it is put back and zeroed;
- the micro-batch's shape is the captured one (a sequence-length stage captures again, once per shape).

Refused in one line (check_cuda_graphs): off CUDA, with more than one rank (DDP's and FSDP2's gradient hooks run
on the host, which a replay skips), and in fp16 (its loss scaler is untested inside a graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from nanopt.config import RunConfig
from nanopt.errors import ConfigError

WARMUP_MICRO_STEPS = 2  # eager micro-steps on a side stream before capture: compile, cuBLAS workspaces, lazy state


def check_cuda_graphs(run: RunConfig, device: torch.device, precision: str, world_size: int) -> None:
    """ConfigError, one line, when train.json's cuda_graphs cannot apply here; nothing when it is off."""
    if not run.train.cuda_graphs:
        return
    where = f"{run.run_dir / 'train.json'}: key 'cuda_graphs': true"
    off = "set \"cuda_graphs\": false"
    if device.type != "cuda":
        raise ConfigError(f"{where} needs a CUDA GPU; this run is on the {device.type}", off)
    if world_size > 1:
        raise ConfigError(f"{where} runs on one GPU only; this run has {world_size} ranks (DDP's and FSDP2's "
                          "gradient hooks run on the host, which a graph's replay skips)", off)
    if precision == "fp16":
        raise ConfigError(f"{where} does not take \"precision\": \"fp16\" (its loss scaler is untested in a graph)",
                          f"set \"precision\": \"bf16\" or \"auto\", or {off}")


class GraphedMicroStep:
    """forward + backward of one micro-batch, `(model(inputs, targets) / accum).backward()`, as a CUDA graph.

    `begin_step(accum)` before a step's first micro-batch, then `run(inputs, targets)` per micro-batch, which
    returns the loss (a tensor the next replay overwrites: read or copy it before then)."""

    def __init__(self, model: torch.nn.Module, parameters: list[torch.nn.Parameter],
                 autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.model = model
        self.parameters = [p for p in parameters if p.requires_grad]
        self.autocast = autocast
        self.graph: torch.cuda.CUDAGraph | None = None
        self.grads: list[torch.Tensor] = []
        self.storages: list[int] = []
        self.inputs = self.targets = self.loss = None
        self.divisor: torch.Tensor | None = None
        self._accum, self._first = 1, True
        self.captures = 0  # how many times a graph was captured: once, plus once per new shape or new storage

    def begin_step(self, accum: int) -> None:
        if self.graph is not None and [p.data_ptr() for p in self.parameters] != self.storages:
            self.graph = None  # the parameters moved: the graph would read and write freed memory
        for param, grad in zip(self.parameters, self.grads, strict=False):
            if param.grad is not grad:
                param.grad = grad
        if self.grads:
            torch._foreach_zero_(self.grads)
        if self.divisor is not None:
            self.divisor.fill_(accum)
        self._accum = accum
        self._first = True

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.graph is None or inputs.shape != self.inputs.shape:
            if not self._first:
                raise RuntimeError("cuda_graphs: the micro-batch shape changed within a step")
            self._capture(inputs, targets)
        self._first = False
        self.inputs.copy_(inputs, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        self.graph.replay()
        return self.loss

    def _forward_backward(self) -> torch.Tensor:
        with self.autocast():
            loss = self.model(self.inputs, self.targets)
        (loss / self.divisor).backward()
        return loss

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """At a step's first micro-batch, when the step's gradients are still zero: the warm-up micro-steps
        accumulate into `.grad` (zeroed again after them), and the capture itself computes nothing."""
        self.graph = None
        self.inputs, self.targets = inputs.clone(), targets.clone()
        self.divisor = torch.full((), float(self._accum), device=inputs.device)
        # Allocated here, on the step's stream, and kept: a replay writes into exactly these tensors.
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.parameters]
        for param, grad in zip(self.parameters, self.grads, strict=True):
            param.grad = grad
        self._warm_up()
        torch._foreach_zero_(self.grads)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the loader's read-ahead thread may copy to the GPU while this thread captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.loss = self._forward_backward()
        self.graph = graph
        self.storages = [p.data_ptr() for p in self.parameters]
        self.captures += 1

    def _warm_up(self) -> None:
        # On a side stream, as CUDA graphs require: the first calls compile, allocate cuBLAS workspaces and set
        # lazily built state, none of which may happen during capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_MICRO_STEPS):
                self._forward_backward()
        torch.cuda.current_stream().wait_stream(side)
