"""`nanopt estimate`: what a run will cost before any GPU is rented, and whether it fits.

Combines a run's configs (or a bare parameter count) with the formulas of `flops`, the memory model and the GPU
table of `hardware` (or this machine's CPU, `--gpu cpu`) into one JSON-ready report, with a verdict on memory and
the changes that would make a run fit. Pure arithmetic: no torch.

Throughput is assumed (an MFU of the device's peak) unless the run directory holds a preflight.json
(nanopt.plan.preflight_record) measured with the run's current settings on the estimate's device and GPU count,
and no MFU was given: then it is the measured tokens/s, and the report says so (`throughput_source`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.hardware import (
    CPU,
    DEFAULT_GPU,
    GIB,
    MAX_PRICE_PER_HOUR,
    MAX_SIZE_BYTES,
    cpu_peak,
    is_cpu,
    machine_memory_bytes,
    resolve_gpu,
)
from nanopt.model import flops
from nanopt.model import memory as memory_model
from nanopt.parsing import INT64_MAX, check_option
from nanopt.plan.preflight_record import changed_setting, fingerprint, read_preflight
from nanopt.rundir import RunDir
from nanopt.shown import shell_word

# The MFU assumed without a measurement: a well-tuned dense run reaches 0.35-0.55; see bench/RESULTS.md.
DEFAULT_MFU = 0.40
MIN_MFU = 0.001  # 0.1% of the peak: below that, no run is worth estimating
# One device's dense peak: from a slow CPU (1 GFLOP/s) to 100 PFLOP/s, 20 x the fastest GPU's low-precision peak.
MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS = 0.001, 100_000


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


def _target(opts: EstimateOptions, precision: str) -> Target:
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


def _run_precision(run: RunConfig | None, on_cpu: bool) -> str:
    # `auto` means bf16 on a GPU and fp32 on a CPU, as training resolves it (nanopt.runtime.resolve_precision).
    if run is None or run.train.precision == "auto":
        return "fp32" if on_cpu else "bf16"
    return run.train.precision


def estimate(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (the keys are documented in README.md)."""
    opts = opts.with_whole_counts()
    if run is None and opts.params is None:
        raise ConfigError("estimate needs a run directory or --params", "e.g. `nanopt estimate runs/gpt2-small`")
    opts, measured, source = _throughput_source(run, opts)
    precision = _run_precision(run, is_cpu(opts.gpu))
    target = _target(opts, precision)
    report: dict[str, Any] = {"run": str(run.run_dir) if run else None}
    report.update(_model_section(run, opts))
    report.update(_budget_section(run, opts, report))
    report.update(_time_section(report, opts, target, measured))
    report["throughput_source"] = source
    report.update(_memory_section(run, opts, target, precision, report["params"]))
    report.update(_batch_section(run, opts))
    report["fit"] = _fit(run, opts.num_gpus, target, precision, report["params"])
    report["parallelism"] = _parallelism(run, target, precision, opts.num_gpus)
    report["attention"] = _attention(run, target, precision)
    return report


def _attention(run: RunConfig | None, target: Target, precision: str) -> dict[str, Any] | None:
    """The SDPA kernel a CUDA training step gets, and a warning when it is the slow, memory-hungry math fallback
    (the memory model counts its scores). None without a run or on a CPU, where SDPA's flash kernel takes all."""
    if run is None or target.is_cpu:
        return None
    return {"kernel": memory_model.attention_kernel(run.model, precision),
            "warning": memory_model.attention_fallback_warning(run.model, precision)}


def _throughput_source(run: RunConfig | None,
                       opts: EstimateOptions) -> tuple[EstimateOptions, float | None, dict[str, Any]]:
    """The options with what was left out taken from the run (its preflight's device and GPU count, train.json's
    price_per_hour), the measured tokens/s to use (None: assume the MFU), and where the throughput comes from."""
    found, problem = read_preflight(run.run_dir) if run is not None else (None, None)
    measured_on = found["device"] if found else {}
    gpu = opts.gpu if opts.gpu is not None else (measured_on.get("kind") or DEFAULT_GPU)
    key = CPU if is_cpu(gpu) else resolve_gpu(gpu)[0].key
    world = measured_on.get("world_size")
    same_device = found is not None and measured_on["kind"] == key
    num_gpus = opts.num_gpus if opts.num_gpus is not None else (world if same_device and key != CPU else 1)
    price = opts.price_per_hour if opts.price_per_hour is not None else (run.train.price_per_hour if run else None)
    opts = replace(opts, gpu=gpu, num_gpus=num_gpus, price_per_hour=price)
    if opts.mfu is not None:  # asked for explicitly: the person's assumption wins over any measurement
        return opts, None, {"kind": "assumed", "mfu": opts.mfu, "note": None}
    note = _unusable(run, found, problem, key, num_gpus) if run is not None else None
    if found is None or note is not None:
        return replace(opts, mfu=DEFAULT_MFU), None, {"kind": "assumed", "mfu": DEFAULT_MFU, "note": note}
    projection = found["projection"]
    return opts, float(found["tokens_per_s"]), {
        "kind": "preflight", "path": str(RunDir(run.run_dir).preflight_json), "device": measured_on["name"],
        "gpu": key, "world_size": world, "measured_at": found["time"], "steps": _number(found["steps"].get("measured")),
        "tokens_per_s": found["tokens_per_s"], "mfu": _number(found.get("mfu")),
        "projected_total_seconds": _number(projection.get("total_s")),
        "projected_cost_usd": _number(projection.get("total_cost_usd")), "failed_checks": found["failed"],
        "note": None}


def _number(value: Any) -> float | None:
    """A number preflight.json gives, or None for one that is missing or not a finite number."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _unusable(run: RunConfig, found: dict[str, Any] | None, problem: str | None, key: str,
              num_gpus: int) -> str | None:
    """Why the run's preflight.json cannot stand for this estimate's throughput, as one note; None if it can (or
    there is none)."""
    path = RunDir(run.run_dir).preflight_json
    if problem is not None:
        return f"{path} not used: {problem}; throughput assumed at MFU {DEFAULT_MFU:g}"
    if found is None:
        return None
    device = found["device"]
    if device["kind"] != key or device["world_size"] != num_gpus:
        return (f"{path} was measured on {device['world_size']} x {device['name']}, not on this estimate's "
                f"{num_gpus} x {key}: throughput assumed at MFU {DEFAULT_MFU:g}")
    changed = changed_setting(found["fingerprint"], fingerprint(run, num_gpus))
    if changed is not None:
        return (f"{path} is stale ({changed}): run `nanopt preflight {shell_word(run.run_dir)}` again to measure the "
                f"run as it is; throughput assumed at MFU {DEFAULT_MFU:g}")
    return None


def _model_section(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    if run is None:
        return {"params": opts.params, "non_embedding_params": None, "seq_len": None,
                "flops_per_token": 6 * opts.params, "flops_per_token_6n": 6 * opts.params,
                "flops_formula": "6N (no architecture given, so no attention term)"}
    count = flops.count_params(run.model)
    return {"params": count.total, "non_embedding_params": count.non_embedding, "seq_len": run.seq_len,
            "flops_per_token": flops.flops_per_token(run.model, run.seq_len),
            "flops_per_token_6n": flops.flops_per_token_6n(run.model),
            "flops_formula": "PaLM: 6 x (non-embedding params + output head) + 12 x layers x hidden x seq_len"}


def _budget_section(run: RunConfig | None, opts: EstimateOptions, report: dict[str, Any]) -> dict[str, Any]:
    optimal = flops.chinchilla_tokens(report["params"], opts.tokens_per_param)
    train_tokens = run.total_tokens if run else (opts.tokens or optimal)
    return {"chinchilla_tokens_per_param": opts.tokens_per_param, "chinchilla_tokens": optimal,
            "train_tokens": train_tokens, "train_tokens_vs_chinchilla": train_tokens / optimal}


def _time_section(report: dict[str, Any], opts: EstimateOptions, target: Target,
                  measured_tokens_per_s: float | None) -> dict[str, Any]:
    """Time and cost at the assumed MFU, or at a preflight's measured tokens/s (its MFU then against this target's
    peak, through the one MFU function)."""
    total_flops = report["train_tokens"] * report["flops_per_token"]
    if measured_tokens_per_s is None:
        seconds = flops.train_seconds(total_flops, opts.num_gpus, target.peak_flops, opts.mfu)
        utilization = opts.mfu
    else:
        seconds = report["train_tokens"] / measured_tokens_per_s
        utilization = flops.mfu(measured_tokens_per_s, report["flops_per_token"], opts.num_gpus, target.peak_flops)
    tokens_per_second = report["train_tokens"] / seconds
    section: dict[str, Any] = {
        "total_flops": total_flops, "train_seconds": seconds, "train_hours": seconds / 3600,
        "cost_usd": _cost(seconds / 3600, opts.num_gpus, target.usd_per_hour),
        "tokens_per_second": tokens_per_second,
        "gpu": {"key": target.key, "name": target.name, "peak_tflops": target.peak_flops / 1e12,
                "peak_source": target.peak_source, "usd_per_hour": target.usd_per_hour, "num_gpus": opts.num_gpus,
                "mfu": utilization, "note": target.note},
        "hours": None,
    }
    if opts.hours:
        tokens = (flops.tokens_in_seconds(opts.hours * 3600, report["flops_per_token"], opts.num_gpus,
                                          target.peak_flops, opts.mfu) if measured_tokens_per_s is None
                  else int(opts.hours * 3600 * measured_tokens_per_s))
        section["hours"] = {"hours": opts.hours, "tokens": tokens,
                            "fraction_of_chinchilla": tokens / report["chinchilla_tokens"],
                            "cost_usd": _cost(opts.hours, opts.num_gpus, target.usd_per_hour)}
    return section


def _cost(hours: float, devices: int, usd_per_hour: float | None) -> float | None:
    return None if usd_per_hour is None else hours * devices * usd_per_hour


def _compiled(run: RunConfig, target: Target) -> bool:
    # `auto` compiles on CUDA only, as training does.
    return run.train.compile is True or (run.train.compile == "auto" and not target.is_cpu)


def _run_memory(run: RunConfig, target: Target, precision: str, world_size: int, *,
                activation_checkpointing: bool | None = None,
                parallelism: str | None = None) -> memory_model.MemoryEstimate:
    """The memory model for the run as configured, or with checkpointing / parallelism changed (what-ifs)."""
    return memory_model.estimate_memory(
        run.model, run.seq_len, precision=precision, compiled=_compiled(run, target),
        activation_checkpointing=(run.train.activation_checkpointing if activation_checkpointing is None
                                  else activation_checkpointing),
        parallelism=parallelism or run.train.parallelism, world_size=world_size, optimizer=run.train.optimizer,
        cuda=not target.is_cpu)


def _memory_section(run: RunConfig | None, opts: EstimateOptions, target: Target, precision: str,
                    params: int) -> dict[str, Any]:
    if run is None:
        states = memory_model.states_only(params)
        return {"memory_bytes": {**states.to_dict(0), "activations_per_sequence": None},
                "gpu_memory_bytes": target.memory_bytes, "max_micro_batch": None, "memory_assumptions": None}
    memory = _run_memory(run, target, precision, opts.num_gpus)
    return {"memory_bytes": memory.to_dict(run.train.micro_batch_size), "gpu_memory_bytes": target.memory_bytes,
            "max_micro_batch": memory.max_micro_batch(target.memory_bytes),
            "memory_assumptions": {"precision": precision, "compile": _compiled(run, target),
                                   "activation_checkpointing": run.train.activation_checkpointing,
                                   "parallelism": run.train.parallelism, "world_size": opts.num_gpus,
                                   "micro_batch_size": run.train.micro_batch_size}}


def _batch_section(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    if run is None:
        return {"optimizer_steps": None, "grad_accum": None, "global_batch_tokens": None}
    try:
        accum: Any = run.grad_accum_steps(opts.num_gpus)
    except ConfigError as exc:  # an estimate still helps; the error text says which numbers would work
        accum = f"inexact: {exc.one_line()}"
    return {"optimizer_steps": run.total_steps, "grad_accum": accum,
            "global_batch_tokens": run.train.global_batch_tokens, "micro_batch_size": run.train.micro_batch_size}


# ------------------------------------------------------------------------------------------------ the verdict

# FSDP is suggested across at most this many GPUs; a run that needs more is told to shrink instead.
MAX_FSDP_GPUS = 4096


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _fit(run: RunConfig | None, world: int, target: Target, precision: str, params: int) -> dict[str, Any]:
    """Whether the run fits the memory of each GPU (or of this machine), and the changes that would make it fit,
    each checked with the same memory model: `set` holds the train.json values (for --set) and `num_gpus` the GPU
    count it needs."""
    if run is None:
        return _states_fit(params, target)
    memory = target.memory_bytes
    wanted = run.train.micro_batch_size
    current = _run_memory(run, target, precision, world)
    largest = current.max_micro_batch(memory)
    if _fits_in(current, wanted, target):
        return {"fits": True, "remedies": [],
                "verdict": f"fits: micro-batch {wanted} needs {_gib(current.total(wanted))} of {_gib(memory)} "
                           f"{target.per_device}; up to about {largest} would fit"}
    if largest >= 1:
        verdict = (f"micro_batch_size {wanted} does not fit: it needs {_gib(current.total(wanted))} of "
                   f"{_gib(memory)} {target.per_device}; up to about {largest} fits")
    else:
        verdict = (f"does not fit in {_gib(memory)} {target.per_device} even at micro-batch 1: it needs "
                   f"{_gib(current.total(1))}")
    remedies = [remedy for remedy in (_smaller_micro_batch(run, world, largest),
                                      _checkpointing(run, world, target, precision, current, largest),
                                      _fsdp(run, world, target, precision, largest)) if remedy]
    if not remedies:
        verdict += ("; no setting nanopt has makes it fit: fewer parameters, a shorter seq_len or a device with "
                    "more memory")
    return {"fits": False, "verdict": verdict, "remedies": remedies}


def _smaller_micro_batch(run: RunConfig, world: int, largest: int) -> dict[str, Any] | None:
    if largest < 1:
        return None
    size = _dividing_micro_batch(run, world, largest)
    return {"set": {"micro_batch_size": size}, "num_gpus": world,
            "text": f"micro_batch_size {size}: gradient accumulation keeps the global batch (`nanopt find-batch "
                    "--write` measures the largest that fits)"}


def _checkpointing(run: RunConfig, world: int, target: Target, precision: str,
                   current: memory_model.MemoryEstimate, largest_now: int) -> dict[str, Any] | None:
    """Activation checkpointing, when it is off and turning it on fits a larger micro-batch than now."""
    if run.train.activation_checkpointing:
        return None
    checkpointed = _run_memory(run, target, precision, world, activation_checkpointing=True)
    largest = checkpointed.max_micro_batch(target.memory_bytes)
    if largest <= largest_now:
        return None
    size = _dividing_micro_batch(run, world, min(largest, run.train.micro_batch_size))
    settings: dict[str, Any] = {"activation_checkpointing": True}
    if size != run.train.micro_batch_size:
        settings["micro_batch_size"] = size
    return {"set": settings, "num_gpus": world,
            "text": f"activation_checkpointing true: activations per sequence "
                    f"{_gib(current.activations_per_sequence)} -> {_gib(checkpointed.activations_per_sequence)} "
                    f"(recomputed in backward, about a third more compute); micro-batch {size} fits"}


def _fsdp(run: RunConfig, world: int, target: Target, precision: str, largest_now: int) -> dict[str, Any] | None:
    """The fewest GPUs (two or more; from the run's own count for a DDP run, more than it for an FSDP one) across
    which FSDP's sharded weights, gradients and optimizer state fit the run's micro-batch, or else, when not even
    micro-batch 1 fits now, micro-batch 1; with activation checkpointing when the activations alone are too large."""
    if target.is_cpu:
        return None
    at_least = max(2, world if run.train.parallelism == "ddp" else world + 1)
    sizes = (run.train.micro_batch_size,) if largest_now >= 1 else (run.train.micro_batch_size, 1)
    for checkpointing in dict.fromkeys((run.train.activation_checkpointing, True)):
        for size in dict.fromkeys(sizes):
            gpus = _fewest_fsdp_gpus(run, target, precision, size, checkpointing, at_least)
            if gpus is not None:
                return _fsdp_remedy(run, target, precision, gpus, checkpointing)
    return None


def _fewest_fsdp_gpus(run: RunConfig, target: Target, precision: str, micro_batch: int, checkpointing: bool,
                      at_least: int) -> int | None:
    def fits(gpus: int) -> bool:
        memory = _run_memory(run, target, precision, gpus, activation_checkpointing=checkpointing,
                             parallelism="fsdp")
        return _fits_in(memory, micro_batch, target)

    one = _run_memory(run, target, precision, 1, activation_checkpointing=checkpointing, parallelism="fsdp")
    room = target.memory_bytes - one.runtime_overhead - micro_batch * one.activations_per_sequence
    if room <= 0:
        return None  # no number of GPUs shards the activations
    gpus = max(at_least, math.ceil((one.weights + one.gradients + one.optimizer) / room))
    while gpus <= MAX_FSDP_GPUS and not fits(gpus):  # the per-GPU shares round up: at most a step or two
        gpus += 1
    return gpus if gpus <= MAX_FSDP_GPUS else None


def _fsdp_remedy(run: RunConfig, target: Target, precision: str, gpus: int, checkpointing: bool) -> dict[str, Any]:
    sharded = _run_memory(run, target, precision, gpus, activation_checkpointing=checkpointing, parallelism="fsdp")
    size = _dividing_micro_batch(run, gpus, min(sharded.max_micro_batch(target.memory_bytes),
                                                run.train.micro_batch_size))
    settings: dict[str, Any] = {"parallelism": "fsdp"}
    if checkpointing and not run.train.activation_checkpointing:
        settings["activation_checkpointing"] = True
    if size != run.train.micro_batch_size:
        settings["micro_batch_size"] = size
    with_checkpointing = ", with activation checkpointing" if "activation_checkpointing" in settings else ""
    return {"set": settings, "num_gpus": gpus,
            "text": f"FSDP across {gpus} GPUs (parallelism \"fsdp\", --num-gpus {gpus}{with_checkpointing}): "
                    f"weights, gradients and optimizer state sharded to "
                    f"{_gib(sharded.weights + sharded.gradients + sharded.optimizer)} per GPU; micro-batch {size} "
                    "fits"}


def _states_fit(params: int, target: Target) -> dict[str, Any]:
    """A bare parameter count: only the weights, gradients and optimizer state (and the runtime) can be judged."""
    needed = memory_model.states_only(params).fixed()
    if needed <= target.memory_bytes:
        return {"fits": True, "remedies": [],
                "verdict": f"weights, gradients and optimizer state fit: {_gib(needed)} of "
                           f"{_gib(target.memory_bytes)} {target.per_device}; activations are not known without "
                           "a run directory"}
    verdict = (f"does not fit: weights, gradients and optimizer state alone need {_gib(needed)}, more than "
               f"{_gib(target.memory_bytes)} {target.per_device}")
    gpus = next((n for n in range(2, MAX_FSDP_GPUS + 1)
                 if memory_model.states_only(params, n).fixed() <= target.memory_bytes), None)
    if target.is_cpu or gpus is None:
        return {"fits": False, "remedies": [], "verdict": verdict + "; only a smaller model would fit"}
    per_gpu = memory_model.states_only(params, gpus).fixed() - memory_model.RUNTIME_OVERHEAD_BYTES
    return {"fits": False, "verdict": verdict, "remedies": [
        {"set": {"parallelism": "fsdp"}, "num_gpus": gpus,
         "text": f"FSDP across {gpus} GPUs (parallelism \"fsdp\", --num-gpus {gpus}): weights, gradients and "
                 f"optimizer state sharded to {_gib(per_gpu)} per GPU, before activations"}]}


def _dividing_micro_batch(run: RunConfig, world: int, limit: int) -> int:
    """The largest micro-batch up to `limit` that divides the global batch exactly over `world` ranks (gradient
    accumulation must be whole); `limit` itself when the global batch is not a whole number of sequences."""
    sequences, remainder = divmod(run.train.global_batch_tokens, run.seq_len * world)
    if remainder or sequences == 0:
        return max(1, limit)
    return max(size for size in range(1, max(1, min(limit, sequences)) + 1) if sequences % size == 0)


# ------------------------------------------------------------------------------------------------ the parallelism

# The GPU counts the parallelism table covers: one node (1 to 8 GPUs) and several (16 to 64); the run's own count
# (--num-gpus) is added when it is not among them.
PARALLELISM_GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Layout:
    """How the training state is spread over the GPUs: train.json's `parallelism` and `activation_checkpointing`."""

    parallelism: str
    activation_checkpointing: bool

    @property
    def name(self) -> str:
        return ("FSDP2" if self.parallelism == "fsdp" else "DDP") + (
            " + activation checkpointing" if self.activation_checkpointing else "")

    @property
    def set_options(self) -> str:
        return (f"--set parallelism={self.parallelism} "
                f"--set activation_checkpointing={str(self.activation_checkpointing).lower()}")

    def to_dict(self) -> dict[str, Any]:
        return {"parallelism": self.parallelism, "activation_checkpointing": self.activation_checkpointing,
                "name": self.name}


# In order of preference, cheapest first. DDP keeps a whole replica per GPU and all-reduces the gradients once per
# step. Activation checkpointing recomputes each block's forward in backward: about a third more compute, a cost
# that is known in advance. FSDP2 all-gathers each block's weights in forward and again in backward and
# reduce-scatters its gradients: 1.5x DDP's traffic every step, whose cost depends on the interconnect and grows
# across nodes; so it comes after checkpointing, and with checkpointing last.
LAYOUTS = (Layout("ddp", False), Layout("ddp", True), Layout("fsdp", False), Layout("fsdp", True))

FIT_RULE = "a layout fits when its predicted per-GPU peak at the row's micro-batch is at most the GPU's memory"


def _fits_in(memory: memory_model.MemoryEstimate, micro_batch: int, target: Target) -> bool:
    """The one rule every memory judgement of the estimate uses: the predicted peak at this micro-batch is at most
    the device's memory (the model's runtime overhead is the headroom)."""
    return memory.total(micro_batch) <= target.memory_bytes


def _candidate_layouts(run: RunConfig, gpus: int) -> tuple[Layout, ...]:
    # FSDP2 needs two ranks or more (on one process training wraps nothing: it is DDP's memory).
    if gpus < 2:
        return LAYOUTS[:2]
    return LAYOUTS


def _parallelism(run: RunConfig | None, target: Target, precision: str, run_gpus: int) -> dict[str, Any] | None:
    """For each GPU count, the cheapest layout that fits the run's micro-batch on the target GPU, by the same memory
    model and rule as the verdict; whether train.json's own layout fits there; and a warning when it does not fit
    at the run's GPU count while another layout would. None without a run directory or on the CPU (one machine)."""
    if run is None or target.is_cpu:
        return None
    own = Layout(run.train.parallelism, run.train.activation_checkpointing)
    rows = [_layout_row(run, target, precision, gpus) for gpus in sorted({*PARALLELISM_GPU_COUNTS, run_gpus})]
    [at_run_gpus] = [r for r in rows if r["gpus"] == run_gpus]
    return {"gpu": target.key, "gpu_memory_bytes": target.memory_bytes, "rule": FIT_RULE, "run_gpus": run_gpus,
            "run_layout": own.to_dict(), "rows": rows,
            "warning": _layout_warning(at_run_gpus, own, target)}


def _layout_row(run: RunConfig, target: Target, precision: str, gpus: int) -> dict[str, Any]:
    micro_batch, note = _row_micro_batch(run, gpus)

    def memory_of(layout: Layout) -> memory_model.MemoryEstimate:
        return _run_memory(run, target, precision, gpus, activation_checkpointing=layout.activation_checkpointing,
                           parallelism=layout.parallelism)

    candidates = _candidate_layouts(run, gpus)
    # The first that fits; when none does, the leanest, to say by how much it is over.
    chosen = next((layout for layout in candidates if _fits_in(memory_of(layout), micro_batch, target)),
                  candidates[-1])
    memory = memory_of(chosen)
    own = _run_memory(run, target, precision, gpus)  # train.json's layout, as the verdict judges it
    row = {"gpus": gpus, "micro_batch_size": micro_batch, "layout": chosen.to_dict(),
           "fits": _fits_in(memory, micro_batch, target), "memory_bytes": memory.total(micro_batch),
           "headroom_bytes": target.memory_bytes - memory.total(micro_batch),
           "max_micro_batch": memory.max_micro_batch(target.memory_bytes), "note": note,
           "run_layout": {"fits": _fits_in(own, micro_batch, target), "memory_bytes": own.total(micro_batch)}}
    row["text"] = _layout_text(row, chosen, target)
    return row


def _layout_text(row: dict[str, Any], layout: Layout, target: Target) -> str:
    needed, memory, micro_batch = row["memory_bytes"], target.memory_bytes, row["micro_batch_size"]
    if row["fits"]:
        return f"{layout.name}: {_gib(needed)} of {_gib(memory)} per GPU at micro-batch {micro_batch}"
    smaller = (f"; micro-batch {row['max_micro_batch']} would fit" if row["max_micro_batch"] >= 1 else "")
    return (f"does not fit: even {layout.name} needs {_gib(needed)} per GPU at micro-batch {micro_batch}, "
            f"{_gib(needed - memory)} over {_gib(memory)}{smaller}")


def _row_micro_batch(run: RunConfig, gpus: int) -> tuple[int, str | None]:
    """train.json's micro-batch, or on this many GPUs the largest below it that keeps gradient accumulation whole,
    with a note when it changed or when the global batch does not split over this many GPUs at all."""
    wanted = run.train.micro_batch_size
    sequences, remainder = divmod(run.train.global_batch_tokens, run.seq_len * gpus)
    if remainder or sequences == 0:
        return wanted, (f"global_batch_tokens {run.train.global_batch_tokens} does not split into whole sequences "
                        f"of {run.seq_len} over {gpus} GPUs: choose a multiple of {run.seq_len * gpus}")
    size = _dividing_micro_batch(run, gpus, wanted)
    if size == wanted:
        return wanted, None
    return size, (f"micro-batch {size}: train.json's {wanted} does not divide the {sequences} sequences per GPU "
                  f"of the global batch on {gpus} GPUs")


def _layout_warning(row: dict[str, Any], own: Layout, target: Target) -> str | None:
    """One line when train.json's layout does not fit at the run's GPU count while another layout does."""
    if row["run_layout"]["fits"] or not row["fits"]:
        return None
    layout = Layout(row["layout"]["parallelism"], row["layout"]["activation_checkpointing"])
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] != 1 else ''}"
    return (f"train.json's {own.name} does not fit on {gpus} of {_gib(target.memory_bytes)} at "
            f"micro-batch {row['micro_batch_size']} (it needs {_gib(row['run_layout']['memory_bytes'])} per GPU); "
            f"{layout.name} does ({_gib(row['memory_bytes'])}): {layout.set_options}")
