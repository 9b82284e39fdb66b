"""`nanopt estimate`'s options: what to estimate on and with which assumptions, each bounded where it is given."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nanopt.errors import ConfigError
from nanopt.hardware import MAX_PRICE_PER_HOUR, MAX_SIZE_BYTES
from nanopt.model import flops
from nanopt.parsing import INT64_MAX, check_option

# The MFU assumed without a measurement: a well-tuned dense run reaches 0.35-0.55; see bench/RESULTS.md.
DEFAULT_MFU = 0.40
MIN_MFU = 0.001  # 0.1% of the peak: below that, no run is worth estimating
# One device's dense peak: from a slow CPU (1 GFLOP/s) to 100 PFLOP/s, 20 x the fastest GPU's low-precision peak.
MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS = 0.001, 100_000
# A compute budget: 1e30 FLOPs is a million times the largest training run reported so far.
MAX_BUDGET_FLOPS = 1e30


@dataclass(frozen=True)
class EstimateOptions:
    gpu: str | None = None  # None: the device of the run's preflight.json, else DEFAULT_GPU
    num_gpus: int | None = None  # None: the preflight's world size when the estimate is for its device, else 1
    mfu: float | None = None  # None: a matching preflight's measured throughput, else DEFAULT_MFU
    price_per_hour: float | None = None  # per GPU; default: train.json price_per_hour, else the table's typical price
    peak_tflops: float | None = None  # overrides the table's dense peak
    gpu_memory: int | None = None  # bytes; overrides the table's memory
    hours: float | None = None  # the inverse question: tokens that fit in this many hours
    tokens_per_param: float = flops.CHINCHILLA_TOKENS_PER_PARAM
    # Counts as typed (7e9 is a float): whole numbers only once validated, as int() of NaN or infinity would raise.
    params: float | None = None  # estimate from a bare parameter count, without a run directory
    tokens: float | None = None  # with params: the token budget (default: Chinchilla-optimal)
    flops: float | None = None  # plan from a compute budget: the compute-optimal model and tokens (budget.py)
    family: str | None = None  # with flops and no run directory: the architecture of the model planned
    compare_gpus: bool = False  # also the run on every GPU of the table, each at the rung it needs
    # On a CPU, the torch threads the run trains with (training's own prediction knows them): a measurement made
    # with another count does not stand for it. None: any count (`nanopt estimate` cannot know training's).
    cpu_threads: int | None = None

    def validate(self) -> None:
        # Bounds far past any real cluster, device, price or budget: a value beyond one is a typo, and NaN or
        # infinity would reach the arithmetic as a ZeroDivisionError or OverflowError. The rates have lower bounds
        # too: a peak or an MFU of 1e-300 would make every time and cost a number of 300 digits.
        hint = "see `nanopt estimate --help`"
        check_option("--num-gpus", self.num_gpus, 1, 10_000_000, hint)
        check_mfu(self.mfu)
        check_option("--price-per-hour", self.price_per_hour, 0, MAX_PRICE_PER_HOUR, hint)
        check_option("--peak-tflops", self.peak_tflops, MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS,
                     "dense TFLOP/s of one device, e.g. 989 for an H100 SXM in bf16, 0.15 for 2 AVX2 cores at 2.4 GHz")
        check_option("--gpu-memory", self.gpu_memory, 0, MAX_SIZE_BYTES, hint, above_low=True)
        check_option("--hours", self.hours, 0, 1_000_000, hint, above_low=True)
        check_option("--chinchilla-ratio", self.tokens_per_param, 0.1, 100_000,
                     "tokens per parameter: 20 is Chinchilla's; over-trained small models use a few hundred")
        check_option("--params", self.params, 1, 10**15, hint)
        check_option("--tokens", self.tokens, 1, INT64_MAX, hint)
        check_option("--flops", self.flops, 1e6, MAX_BUDGET_FLOPS, "total training FLOPs, e.g. 1e21")
        given = [name for name, value in (("--params", self.params), ("--tokens", self.tokens),
                                          ("--hours", self.hours)) if value is not None]
        if self.flops is not None and given:
            raise ConfigError(f"--flops with {given[0]}: a compute budget decides the parameters and tokens itself",
                              f"leave out {given[0]}, or leave out --flops")
        if self.family is not None and self.flops is None:
            raise ConfigError("--family without --flops: it names the architecture of the model --flops plans",
                              "add --flops C, e.g. --flops 1e21 --family gpt2")

    def with_whole_counts(self) -> EstimateOptions:
        """These options validated, with --params and --tokens as the whole numbers the arithmetic counts in."""
        self.validate()
        return replace(self, params=_whole(self.params), tokens=_whole(self.tokens))


def check_mfu(mfu: float | None) -> None:
    """MFU is a fraction, one way only: 0.4 means 40%. A percentage (40) is refused with what it would mean, not
    read as 4000% nor guessed at (is 1 then 100% or 1%?)."""
    if mfu is None:
        return
    if isinstance(mfu, (int, float)) and 1 < mfu <= 100:
        raise ConfigError(f"--mfu {mfu:g} is more than 1: MFU is a fraction of the peak",
                          f"--mfu {mfu / 100:g} means {mfu:g}% (a well-tuned dense run reaches 0.35-0.55)")
    check_option("--mfu", mfu, MIN_MFU, 1, "a fraction of the peak: --mfu 0.4 means 40%")


def _whole(count: float | None) -> int | None:
    return None if count is None else int(count)
