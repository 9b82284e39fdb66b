"""Accelerators nanopt knows: dense peak throughput, memory and a typical on-demand price.

Peaks are the vendors' dense (non-sparse) tensor-core figures with fp32 accumulation, per GPU. MFU is always
computed against the peak of the dtype the run uses; sparsity figures are never used. Prices are typical
on-demand cloud rates in late 2026 and only a default: pass --price-per-hour for your provider's.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanopt.errors import ConfigError

GIB = 1 << 30
GB = 10**9


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    bf16_tflops: float  # dense bf16 / fp16 tensor-core peak with fp32 accumulation
    tf32_tflops: float  # dense tf32 tensor-core peak: what fp32 matmuls reach with TF32 enabled
    memory_bytes: int
    usd_per_hour: float

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for the compute dtype: bf16/fp16 tensor cores, or TF32 for fp32 runs."""
        tflops = self.tf32_tflops if precision == "fp32" else self.bf16_tflops
        return tflops * 1e12


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("a100-40gb", "NVIDIA A100 40GB SXM", 312.0, 156.0, 40 * GIB, 1.29),
    GPU("a100-80gb", "NVIDIA A100 80GB SXM", 312.0, 156.0, 80 * GIB, 1.79),
    GPU("h100-sxm", "NVIDIA H100 SXM 80GB", 989.4, 494.7, 80 * GIB, 2.99),
    GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 756.0, 378.0, 80 * GIB, 2.49),
    GPU("h200", "NVIDIA H200 141GB", 989.4, 494.7, 141 * GB, 3.79),
    GPU("b200", "NVIDIA B200 180GB", 2250.0, 1100.0, 180 * GB, 5.99),
    GPU("l4", "NVIDIA L4 24GB", 121.0, 60.0, 24 * GB, 0.80),
    GPU("a10", "NVIDIA A10 24GB", 125.0, 62.5, 24 * GB, 0.75),
    GPU("rtx-3090", "NVIDIA GeForce RTX 3090 24GB", 71.0, 35.6, 24 * GB, 0.22),
    GPU("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 165.2, 82.6, 24 * GB, 0.35),
)}

DEFAULT_GPU = "h100-sxm"


def get_gpu(key: str) -> GPU:
    normalized = key.lower().replace("_", "-").replace(" ", "-")
    if normalized in GPUS:
        return GPUS[normalized]
    raise ConfigError(f"--gpu: unknown GPU '{key}'",
                      f"known: {', '.join(GPUS)}; or pass --peak-tflops and --gpu-memory for another accelerator")


def detect_gpu(device_name: str) -> GPU | None:
    """Match torch.cuda.get_device_name() to the table, for MFU in train/profile/find-batch."""
    name = device_name.lower()
    rules = [("b200", "b200"), ("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100-sxm"),
             ("a100", "a100-80gb" if "80" in name else "a100-40gb"), ("l4", "l4"), ("a10", "a10"),
             ("3090", "rtx-3090"), ("4090", "rtx-4090")]
    for needle, key in rules:
        if needle in name:
            return GPUS[key]
    return None


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """'40GiB', '40GB', '512MiB', '2G' -> bytes (G / GiB are binary, GB decimal)."""
    units = {"tib": 1 << 40, "gib": GIB, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": GB, "mb": 10**6,
             "kb": 10**3, "t": 1 << 40, "g": GIB, "m": 1 << 20, "k": 1 << 10, "b": 1, "": 1}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"{option}: cannot read size '{text}'", "write it like 40GiB, 80GB or 512MiB")
    return int(value * units[unit])
