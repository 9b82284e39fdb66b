"""What `nanopt plan` is asked for (PlanOptions, each option bounded where it is given), the device it plans for,
and the memory ladder's rung it picks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError
from nanopt.hardware import DEFAULT_GPU, MAX_PRICE_PER_HOUR, is_cpu
from nanopt.parsing import check_option
from nanopt.plan.estimate import check_mfu
from nanopt.plan.estimate.budget import FAMILY_TEMPLATES
from nanopt.plan.estimate.target import Target
from nanopt.plan.prediction import setup_seconds


@dataclass(frozen=True)
class PlanOptions:
    budget: str
    data: Path
    out: Path
    gpu: str = DEFAULT_GPU
    num_gpus: int = 1
    price_per_hour: float | None = None
    family: str = "llama"
    mfu: float | None = None
    max_epochs: float = 4.0

    def validate(self) -> None:
        hint = "see `nanopt plan --help`"
        check_option("--num-gpus", self.num_gpus, 1, 100_000, hint)
        check_option("--price-per-hour", self.price_per_hour, 0, MAX_PRICE_PER_HOUR, "USD per GPU-hour, e.g. 2.99")
        check_mfu(self.mfu)
        check_option("--max-epochs", self.max_epochs, 0, 1e6, "passes over the train split, e.g. 4", above_low=True)
        if self.family not in FAMILY_TEMPLATES:
            raise ConfigError(f"--family {self.family!r} is not an architecture nanopt builds", "use llama or gpt2")
        if is_cpu(self.gpu) and self.num_gpus != 1:
            raise ConfigError(f"--num-gpus {self.num_gpus} with --gpu cpu: a CPU plan is for this one machine",
                              "leave out --num-gpus, or name the GPUs with --gpu")


@dataclass(frozen=True)
class Device:
    """The device the plan is for, and what one second of its training computes."""

    target: Target
    gpu: str
    num_gpus: int
    precision: str
    mfu: float

    @property
    def on_cpu(self) -> bool:
        return self.target.is_cpu

    @property
    def flops_per_second(self) -> float:
        return self.num_gpus * self.target.peak_flops * self.mfu

    @property
    def setup_s(self) -> float:
        return setup_seconds(self.on_cpu, compiled=not self.on_cpu)  # train.json's compile "auto": on CUDA only


@dataclass(frozen=True)
class Memory:
    settings: dict[str, Any]  # parallelism, activation_checkpointing, optimizer
    rung: str
    max_micro_batch: int
    slowdown: float
