"""The device an estimate is for (a GPU of the table, or this machine's CPU), and the memory model of a run on
it: the one rule every memory judgement of the estimate uses (`fits_in`), shared by the verdict and the
parallelism table."""

from __future__ import annotations

from dataclasses import dataclass

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.hardware import CPU, GIB, cpu_peak, is_cpu, machine_memory_bytes, resolve_gpu
from nanopt.model import memory as memory_model
from nanopt.plan.estimate.options import EstimateOptions


@dataclass(frozen=True)
class Target:
    """What a run is estimated on: a GPU of the table (its figures overridden by options), or this machine's CPU."""

    key: str
    name: str
    peak_flops: float
    peak_source: str
    memory_bytes: int
    usd_per_hour: float | None  # None: no price is known (your own machine)
    note: str | None = None  # which card a short name (h100) was taken to mean

    @property
    def is_cpu(self) -> bool:
        return self.key == CPU

    @property
    def per_device(self) -> str:
        return "of this machine's memory" if self.is_cpu else "per GPU"


def target_for(opts: EstimateOptions, precision: str) -> Target:
    if is_cpu(opts.gpu):
        return _this_machine(opts)
    gpu, note = resolve_gpu(opts.gpu)
    peak, source = ((opts.peak_tflops * 1e12, "--peak-tflops") if opts.peak_tflops
                    else (gpu.peak_flops(precision), "dense table peak"))
    price = gpu.usd_per_hour if opts.price_per_hour is None else opts.price_per_hour
    return Target(gpu.key, gpu.name, peak, source, opts.gpu_memory or gpu.memory_bytes, price, note)


def _this_machine(opts: EstimateOptions) -> Target:
    """`--gpu cpu`: the processor's dense fp32 peak (cores x clock x FLOPs per cycle, or --peak-tflops), the
    machine's memory (or --gpu-memory), and no price unless --price-per-hour gives one."""
    if opts.num_gpus != 1:
        raise ConfigError(f"--num-gpus {opts.num_gpus} with --gpu cpu: a CPU estimate is of this one machine",
                          "leave out --num-gpus, or name the GPUs with --gpu")
    if opts.peak_tflops:
        peak, source = opts.peak_tflops * 1e12, "--peak-tflops"
    else:
        found = cpu_peak()
        if found is None:
            raise ConfigError("--gpu cpu: cannot tell this processor's peak FLOP/s (no /proc/cpuinfo, or vector "
                              "units nanopt does not know)", "pass --peak-tflops: cores x GHz x fp32 FLOPs per "
                              "cycle / 1000, e.g. 0.15 for 2 AVX2 cores at 2.4 GHz (32 FLOPs per cycle)")
        peak, source = found.flops, found.describe()
    return Target(CPU, "this machine's CPU", peak, source, opts.gpu_memory or machine_memory_bytes(),
                  opts.price_per_hour)


def run_precision(run: RunConfig | None, on_cpu: bool, bf16: bool = True) -> str:
    # `auto` means bf16 on a GPU with bf16 (`bf16`), fp16 on one without, fp32 on a CPU, as training resolves it
    # (nanopt.runtime.resolve_precision).
    if run is None or run.train.precision == "auto":
        return "fp32" if on_cpu else "bf16" if bf16 else "fp16"
    return run.train.precision


def has_bf16(gpu: str) -> bool:
    """Whether --gpu's card has bf16 tensor cores (a CPU estimate: irrelevant, fp32)."""
    return not is_cpu(gpu) and resolve_gpu(gpu)[0].bf16


def compiled(run: RunConfig, target: Target) -> bool:
    # `auto` compiles on CUDA only, as training does.
    return run.train.compile is True or (run.train.compile == "auto" and not target.is_cpu)


def run_memory(run: RunConfig, target: Target, precision: str, world_size: int, *,
                activation_checkpointing: bool | int | str | None = None,
                parallelism: str | None = None, optimizer: str | None = None) -> memory_model.MemoryEstimate:
    """The memory model for the run as configured, or with checkpointing / parallelism changed (what-ifs)."""
    return memory_model.estimate_memory(
        run.model, run.seq_len, precision=precision, compiled=compiled(run, target),
        activation_checkpointing=(run.train.activation_checkpointing if activation_checkpointing is None
                                  else activation_checkpointing),
        parallelism=parallelism or run.train.parallelism, world_size=world_size,
        optimizer=optimizer or run.train.optimizer,
        cuda=not target.is_cpu, step_sequences=run.sequences_per_rank(world_size), health=run.train.health,
        weight_copies=run.train.bf16_weight_copies)


def fits_in(memory: memory_model.MemoryEstimate, micro_batch: int, target: Target) -> bool:
    """The one rule every memory judgement of the estimate uses: the predicted peak at this micro-batch is at most
    the device's memory (the model's runtime overhead is the headroom)."""
    return memory.total(micro_batch) <= target.memory_bytes


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def dividing_micro_batch(run: RunConfig, world: int, limit: int) -> int:
    """The largest micro-batch up to `limit` that divides the global batch exactly over `world` ranks (gradient
    accumulation must be whole; under batch warmup, its first and smallest batch); `limit` itself when the global
    batch is not a whole number of sequences."""
    smallest = run.train.batch_warmup_start_tokens or run.train.global_batch_tokens
    sequences, remainder = divmod(smallest, run.seq_len * world)
    if remainder or sequences == 0:
        return max(1, limit)
    return max(size for size in range(1, max(1, min(limit, sequences)) + 1) if sequences % size == 0)
