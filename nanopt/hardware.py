"""Accelerators nanopt knows: dense peak throughput, memory and a typical on-demand price; and this machine's CPU
(its peak worked out from cores, clock and vector units, its memory) for `nanopt estimate --gpu cpu`, and the cores
a process may use and how busy other work keeps them (from which nanopt.cpu_threads chooses torch's CPU threads).

Peaks are the vendors' dense (non-sparse) tensor-core figures with fp32 accumulation, per GPU. MFU is always
computed against the peak of the dtype the run uses; sparsity figures are never used. Prices are typical
on-demand cloud rates in late 2026 and only a default: pass --price-per-hour for your provider's.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from nanopt.errors import ConfigError

GIB = 1 << 30
MIB = 1 << 20
GB = 10**9


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    bf16_tflops: float  # dense bf16 / fp16 tensor-core peak with fp32 accumulation
    tf32_tflops: float  # dense tf32 tensor-core peak: what fp32 matmuls reach with TF32 enabled
    memory_bytes: int
    usd_per_hour: float
    device_words: tuple[str, ...]  # the words of torch.cuda.get_device_name() that identify this card
    bf16: bool = True  # bf16 tensor cores (Ampere and newer); without them `precision: auto` means fp32

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for the compute dtype: bf16/fp16 tensor cores, or TF32 for fp32 runs."""
        tflops = self.tf32_tflops if precision == "fp32" else self.bf16_tflops
        return tflops * 1e12


# Sources: NVIDIA's datasheets and architecture whitepapers, halving every "with sparsity" figure. GeForce cards
# (and AWS's A10G) run bf16 with fp32 accumulation at half their fp16-accumulate rate; that half is listed.
# Memory: the total nvidia-smi reports for the card, in MiB, not the name's "GB", which is decimal on some cards and
# binary on others (the H100 NVL's "94GB" is 95,830 MiB, 7% more than 94 * 10**9 bytes; the H200's "141GB" is
# 143,771 MiB). torch's total_memory, which find-batch and the run see, is 0-1% less (the driver's reserve): 81,079
# MiB on the H100 SXM and 143,156 on the H200 of nanopt's GPU windows. Cards with ECC on GDDR (L40S, L40, A40, A10,
# L4) by default report 1/16 less than with it off (46,068 MiB against 49,140 on a 48 GB card).
GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("a100-40gb", "NVIDIA A100 40GB SXM", 312.0, 156.0, 40_960 * MIB, 1.29, ("a100",)),
    GPU("a100-80gb", "NVIDIA A100 80GB SXM", 312.0, 156.0, 81_920 * MIB, 1.79, ("a100", "80gb")),
    GPU("h100-sxm", "NVIDIA H100 SXM 80GB", 989.4, 494.7, 81_559 * MIB, 2.99, ("h100",)),
    GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 756.0, 378.0, 81_559 * MIB, 2.49, ("h100", "pcie")),
    GPU("h100-nvl", "NVIDIA H100 NVL 94GB", 835.5, 417.5, 95_830 * MIB, 2.79, ("h100", "nvl")),
    GPU("h200", "NVIDIA H200 141GB", 989.4, 494.7, 143_771 * MIB, 3.79, ("h200",)),
    GPU("h200-nvl", "NVIDIA H200 NVL 141GB", 835.5, 417.5, 143_771 * MIB, 3.49, ("h200", "nvl")),
    GPU("gh200", "NVIDIA GH200 96GB", 989.4, 494.7, 97_871 * MIB, 1.49, ("gh200",)),
    GPU("b200", "NVIDIA B200 180GB", 2250.0, 1100.0, 183_359 * MIB, 5.99, ("b200",)),
    GPU("l40s", "NVIDIA L40S 48GB", 362.05, 183.0, 46_068 * MIB, 1.09, ("l40s",)),
    GPU("l40", "NVIDIA L40 48GB", 181.05, 90.5, 46_068 * MIB, 0.89, ("l40",)),
    GPU("l4", "NVIDIA L4 24GB", 121.0, 60.0, 23_034 * MIB, 0.80, ("l4",)),
    GPU("a40", "NVIDIA A40 48GB", 149.7, 74.8, 46_068 * MIB, 0.44, ("a40",)),
    GPU("a10", "NVIDIA A10 24GB", 125.0, 62.5, 23_028 * MIB, 0.75, ("a10",)),
    GPU("a10g", "NVIDIA A10G 24GB (AWS)", 70.0, 35.0, 23_028 * MIB, 1.01, ("a10g",)),
    GPU("rtx-a6000", "NVIDIA RTX A6000 48GB", 154.8, 77.4, 49_140 * MIB, 0.79, ("a6000",)),
    GPU("rtx-6000-ada", "NVIDIA RTX 6000 Ada 48GB", 364.2, 182.1, 49_140 * MIB, 0.99, ("6000", "ada")),
    GPU("rtx-3090", "NVIDIA GeForce RTX 3090 24GB", 71.0, 35.6, 24_576 * MIB, 0.22, ("3090",)),
    GPU("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 165.2, 82.6, 24_564 * MIB, 0.35, ("4090",)),
    GPU("rtx-5090", "NVIDIA GeForce RTX 5090 32GB", 209.5, 104.8, 32_607 * MIB, 0.69, ("5090",)),
    # Before Ampere: fp16 tensor cores only (the first figure), and no TF32: fp32 runs at the CUDA cores' rate.
    GPU("t4", "NVIDIA T4 16GB", 65.0, 8.1, 15360 * MIB, 0.35, ("t4",), bf16=False),
    GPU("v100-16gb", "NVIDIA V100 SXM2 16GB", 125.0, 15.7, 16160 * MIB, 0.99, ("v100", "16gb"), bf16=False),
    GPU("v100-32gb", "NVIDIA V100 SXM2 32GB", 125.0, 15.7, 32768 * MIB, 1.29, ("v100", "32gb"), bf16=False),
)}

DEFAULT_GPU = "h100-sxm"

# USD per GPU-hour: a thousand times today's dearest card. A price past it is a typo, and would make every cost a
# number nobody could pay (or an infinity). The bound of every --price-per-hour and of train.json's price_per_hour.
MAX_PRICE_PER_HOUR = 1_000_000


def check_price_per_hour(price_per_hour: float | None) -> None:
    """ConfigError unless --price-per-hour (None: not given) is a finite number of USD from 0 to the bound above: the
    one check of the option on every command that takes it (train, preflight, eval)."""
    from nanopt.parsing import check_option

    check_option("--price-per-hour", price_per_hour, 0, MAX_PRICE_PER_HOUR, "USD per GPU-hour, e.g. 2.99")

# Short names people type: the card each is taken to mean, and how to ask for the others it could mean.
ALIASES: dict[str, tuple[str, str]] = {
    "h100": ("h100-sxm", "pass --gpu h100-pcie or h100-nvl for the PCIe or NVL card"),
    "h200-sxm": ("h200", "pass --gpu h200-nvl for the NVL card"),
    "a100": ("a100-80gb", "pass --gpu a100-40gb for the 40 GB card"),
    "a100-80": ("a100-80gb", ""),
    "a100-40": ("a100-40gb", ""),
    "6000-ada": ("rtx-6000-ada", ""),
    "a6000": ("rtx-a6000", ""),
    "3090": ("rtx-3090", ""),
    "4090": ("rtx-4090", ""),
    "5090": ("rtx-5090", ""),
}

# Words that make a card another card than the one named before them (RTX 3090 Ti, RTX 4090 Laptop GPU,
# RTX 4090 D): a name with one of them matches only an entry that lists it.
VARIANT_WORDS = frozenset({"ti", "super", "laptop", "mobile", "max", "d"})


def get_gpu(key: str) -> GPU:
    """The table entry for --gpu: a key, in any spelling (H100_PCIE, rtx4090), or an alias (h100)."""
    return resolve_gpu(key)[0]


def resolve_gpu(key: str) -> tuple[GPU, str | None]:
    """The table entry for --gpu, and for an alias a one-line note saying which card it was taken to mean."""
    wanted = _squash(key)
    for name, gpu in GPUS.items():
        if _squash(name) == wanted:
            return gpu, None
    for alias, (name, others) in ALIASES.items():
        if _squash(alias) == wanted:
            gpu = GPUS[name]
            return gpu, f"{key} -> {gpu.name}" + (f"; {others}" if others else "")
    raise ConfigError(f"--gpu: unknown GPU '{key}'",
                      f"known: {', '.join(GPUS)} (or short names: {', '.join(ALIASES)}), or {CPU} for this "
                      "machine's processor; --peak-tflops and --gpu-memory describe another accelerator")


def _squash(key: str) -> str:
    """'H100_PCIe', 'h100 pcie' and 'h100pcie' all read as 'h100pcie'."""
    return "".join(ch for ch in key.lower() if ch.isalnum())


def detect_gpu(device_name: str) -> GPU | None:
    """Match torch.cuda.get_device_name() to the table, for MFU in train/profile/find-batch; None if not there.

    Names are compared word by word, never as substrings: "NVIDIA L40S" is not an L4, "NVIDIA GH200 480GB" not an
    H200. Of the entries whose words all appear in the name, the one with the most words wins ("NVIDIA H100 NVL"
    is the NVL entry, not the plain H100). A card that is not in the table gets no peak rather than a wrong one.
    """
    words = set(device_name.lower().replace("-", " ").replace("_", " ").split())
    variants = words & VARIANT_WORDS
    matches = [gpu for gpu in GPUS.values() if set(gpu.device_words) <= words and variants <= set(gpu.device_words)]
    return max(matches, key=lambda gpu: len(gpu.device_words), default=None)


# The largest memory size an option may give: 1 EiB, a million times today's largest GPU. Past it a size is a typo,
# and NaN or infinity would fail inside int() with a traceback.
MAX_SIZE_BYTES = 1 << 60


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """'40GiB', '40GB', '512MiB', '2G' -> bytes (G / GiB are binary, GB decimal), from 1 byte to MAX_SIZE_BYTES."""
    units = {"tib": 1 << 40, "gib": GIB, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": GB, "mb": 10**6,
             "kb": 10**3, "t": 1 << 40, "g": GIB, "m": 1 << 20, "k": 1 << 10, "b": 1, "": 1}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        size = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ConfigError(f"{option}: cannot read size {text[:40]!r}", "write it like 40GiB, 80GB or 512MiB") from None
    if not 1 <= size <= MAX_SIZE_BYTES:  # also NaN and infinity
        raise ConfigError(f"{option}: size {text[:40]!r} is outside 1 byte to 1 EiB",
                          "write it like 40GiB, 80GB or 512MiB")
    return int(size)


# ------------------------------------------------------------------------------------------------ this machine

CPU = "cpu"  # `nanopt estimate --gpu cpu`: training on this machine's processor, in its memory

# Dense fp32 FLOPs per cycle of one core, by the vector instructions /proc/cpuinfo lists: two fused multiply-add units
# (2 FLOPs per lane) of 256 bits on x86 with AVX2 (AVX-512 cores may reach twice that; not assumed), of 128 bits on
# Arm (Apple's and Graviton 3's cores have four). fp32, as training on a CPU runs (`auto` precision).
# (flags the CPU must list, fp32 FLOP per cycle per core, what computes them), the widest first. AVX-512 counts as
# two 512-bit FMA units on Intel's server cores (a 2-core cloud Xeon here ran a 2048^3 fp32 matmul at 375 GFLOP/s,
# past the 134 its AVX2 units could give at 2.1 GHz); AMD's Zen 4 runs AVX-512 on its 256-bit units, so an AMD
# CPU is counted by its AVX2 units.
CPU_FLOPS_PER_CYCLE = (("avx512f", 64, "two 512-bit FMA units (AVX-512)", "GenuineIntel"),
                       ("avx2 fma", 32, "two 256-bit FMA units (AVX2)", None),
                       ("asimd", 16, "two 128-bit FMA units (NEON)", None))


def is_cpu(key: str) -> bool:
    return _squash(key) == CPU


@dataclass(frozen=True)
class CPUPeak:
    cores: int
    ghz: float
    flops_per_cycle: int
    units: str

    @property
    def flops(self) -> float:
        return self.cores * self.ghz * 1e9 * self.flops_per_cycle

    def describe(self) -> str:
        return (f"{self.cores} cores x {self.ghz:.2f} GHz x {self.flops_per_cycle} fp32 FLOP/cycle ({self.units}), "
                "from /proc/cpuinfo")


def cpu_peak(cpuinfo: Path = Path("/proc/cpuinfo")) -> CPUPeak | None:
    """This machine's dense fp32 peak, worked out from its cores, clock and vector units; None where /proc/cpuinfo
    does not say (not Linux, an unknown instruction set): --peak-tflops then gives it."""
    import psutil

    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    features = set((fields.get("flags") or fields.get("features") or "").split())
    vendor = fields.get("vendor_id")
    match = next((entry for entry in CPU_FLOPS_PER_CYCLE
                  if set(entry[0].split()) <= features and entry[3] in (None, vendor)), None)
    frequency = psutil.cpu_freq()
    mhz = (frequency.max or frequency.current) if frequency else float(fields.get("cpu mhz") or 0)
    if match is None or not mhz:
        return None
    # Physical cores (two hardware threads share one core's units), no more than this process may run on, nor than
    # its container's CPU quota allows.
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return CPUPeak(cores=cores, ghz=mhz / 1000, flops_per_cycle=match[1], units=match[2])


def machine_memory_bytes() -> int:
    """This machine's memory, or the container's memory limit (cgroup v2 or v1) where that is lower."""
    import psutil

    total = psutil.virtual_memory().total
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        try:
            text = limit.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 writes "max" for no limit
            total = min(total, int(text))
    return total


# ------------------------------------------------------------------------- the cores a process may use, and how busy

@dataclass(frozen=True)
class CPUCores:
    """The cores a process may run its threads on: the logical CPUs of its affinity mask (taskset, a container's
    cpuset), the physical cores among them, and the container's CPU quota (cgroup), in CPUs, where it has one."""

    cpus: frozenset[int]
    physical: int  # two hardware threads of one core share its vector units: torch's default counts cores
    quota: float | None  # e.g. 1.5 for `docker run --cpus 1.5`; None: no quota (or none readable)
    machine: int  # the machine's logical CPUs, for the start-up line

    @property
    def usable(self) -> int:
        """How many threads these cores run at full speed: the physical cores, and no more than the quota's whole
        CPUs (a thread past the quota is throttled for the rest of each period, and its partners wait for it)."""
        cores = max(1, self.physical)
        if self.quota is not None:
            cores = min(cores, max(1, math.floor(self.quota)))
        return cores


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD", or "max PERIOD" for no quota
CGROUP_V1_CPU = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")
PROC_STAT = Path("/proc/stat")


def cpu_cores(cpu_max: Path = CGROUP_CPU_MAX, cfs: tuple[Path, Path] = CGROUP_V1_CPU,
              topology: Path = CPU_TOPOLOGY) -> CPUCores:
    """The cores this process may use (see CPUCores). Never raises: what cannot be read is left out."""
    machine = os.cpu_count() or 1
    cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(machine))
    return CPUCores(cpus=cpus, physical=physical_cores(cpus, topology), quota=cpu_quota(cpu_max, cfs),
                    machine=machine)


def cpu_quota(cpu_max: Path = CGROUP_CPU_MAX, cfs: tuple[Path, Path] = CGROUP_V1_CPU) -> float | None:
    """The CPUs the container's quota allows (quota / period: 1.5 for `--cpus 1.5`), from cgroup v2's cpu.max, else
    v1's cfs_quota_us and cfs_period_us; None where there is no quota ("max", -1), or no file, or one that does not
    read as two positive numbers."""
    text = _read(cpu_max)
    if text is not None:
        fields = text.split()
        return _ratio(fields[0], fields[1]) if len(fields) == 2 else None
    quota, period = (_read(path) for path in cfs)
    return _ratio(quota, period) if quota is not None and period is not None else None


def _ratio(quota: str, period: str) -> float | None:
    try:
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):  # "max" (v2) or garbage
        return None
    return value if value > 0 else None  # v1 writes -1 for no quota


def physical_cores(cpus: frozenset[int], topology: Path = CPU_TOPOLOGY) -> int:
    """The physical cores among logical CPUs `cpus` (distinct package and core ids in sysfs); len(cpus) where sysfs
    does not say for every one of them."""
    cores = set()
    for cpu in cpus:
        package, core = (_read(topology / f"cpu{cpu}" / "topology" / name)
                         for name in ("physical_package_id", "core_id"))
        if package is None or core is None:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def cpu_ticks(cpus: frozenset[int], stat: Path = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) clock ticks that logical CPUs `cpus` have spent since boot, from /proc/stat's per-CPU lines:
    busy is all but idle and iowait (steal, time the hypervisor gave other machines, is busy). None where the file
    cannot be read, or a CPU of `cpus` has no line of numbers."""
    text = _read(stat)
    if text is None:
        return None
    found: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, _, values = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        try:
            # user nice system idle iowait irq softirq steal (guest and guest_nice are inside user and nice)
            ticks = [int(v) for v in values.split()[:8]]
        except ValueError:
            return None
        if len(ticks) < 5:
            return None
        total = sum(ticks)
        found[int(name[3:])] = (total - ticks[3] - ticks[4], total)
    if set(found) != set(cpus):
        return None
    return sum(busy for busy, _ in found.values()), sum(total for _, total in found.values())


def other_work(cpus: frozenset[int], seconds: float = 0.25, stat: Path = PROC_STAT) -> float | None:
    """How many of logical CPUs `cpus` other work keeps busy, in CPUs (1.0: one CPU's worth), over a sample of
    `seconds`; None where /proc/stat cannot be read. See busy_elsewhere."""
    before, own_before = cpu_ticks(cpus, stat), _own_cpu_seconds()
    if before is None:
        return None
    time.sleep(seconds)
    after, own = cpu_ticks(cpus, stat), _own_cpu_seconds() - own_before
    if after is None:
        return None
    return busy_elsewhere(before, after, own, len(cpus), os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


def busy_elsewhere(before: tuple[int, int], after: tuple[int, int], own_s: float, cpus: int,
                   ticks_per_s: float) -> float | None:
    """From two (busy, total) readings of `cpus` CPUs (cpu_ticks), the CPUs' worth of work other than this
    process's own `own_s` CPU-seconds (all its threads) between them; None when the readings say nothing (no tick
    passed, or a counter went back)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    if total <= 0 or busy < 0:
        return None
    others = max(0.0, busy - own_s * ticks_per_s)
    return min(float(cpus), cpus * others / total)


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except (OSError, ValueError):
        return None
