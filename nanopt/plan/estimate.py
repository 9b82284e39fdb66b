"""`nanopt estimate`: what a run will cost before any GPU is rented.

Combines a run's configs (or a bare parameter count) with the formulas of `flops` and the GPU table of
`hardware` into one JSON-ready report. Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.hardware import DEFAULT_GPU, GPU, MAX_SIZE_BYTES, get_gpu
from nanopt.model import flops
from nanopt.model import memory as memory_model
from nanopt.parsing import INT64_MAX, check_option

# USD per GPU-hour: a thousand times today's dearest card. A price past it is a typo, and would make every cost a
# number nobody could pay (or an infinity). Also the bound of `nanopt eval --price-per-hour`.
MAX_PRICE_PER_HOUR = 1_000_000


@dataclass(frozen=True)
class EstimateOptions:
    gpu: str = DEFAULT_GPU
    num_gpus: int = 1
    mfu: float = 0.40  # a well-tuned dense run reaches 0.35-0.55; see bench/RESULTS.md
    price_per_hour: float | None = None  # per GPU; default: the table's typical on-demand price
    peak_tflops: float | None = None  # overrides the table's dense peak
    gpu_memory: int | None = None  # bytes; overrides the table's memory
    hours: float | None = None  # the inverse question: tokens that fit in this many hours
    tokens_per_param: float = flops.CHINCHILLA_TOKENS_PER_PARAM
    # Counts as typed (7e9 is a float): whole numbers only once validated, as int() of NaN or infinity would raise.
    params: float | None = None  # estimate from a bare parameter count, without a run directory
    tokens: float | None = None  # with params: the token budget (default: Chinchilla-optimal)

    def validate(self) -> None:
        # Upper bounds far past any real cluster, GPU, price or budget: a value beyond one is a typo, and NaN or
        # infinity would reach the arithmetic as a ZeroDivisionError or OverflowError.
        hint = "see `nanopt estimate --help`"
        check_option("--num-gpus", self.num_gpus, 1, 10_000_000, hint)
        check_option("--mfu", self.mfu, 0, 1, "a fraction such as 0.4", above_low=True)
        check_option("--price-per-hour", self.price_per_hour, 0, MAX_PRICE_PER_HOUR, hint)
        check_option("--peak-tflops", self.peak_tflops, 0, 1e9, hint, above_low=True)
        check_option("--gpu-memory", self.gpu_memory, 0, MAX_SIZE_BYTES, hint, above_low=True)
        check_option("--hours", self.hours, 0, 1_000_000, hint, above_low=True)
        check_option("--chinchilla-ratio", self.tokens_per_param, 0, 1_000_000, hint, above_low=True)
        check_option("--params", self.params, 1, 10**15, hint)
        check_option("--tokens", self.tokens, 1, INT64_MAX, hint)

    def with_whole_counts(self) -> EstimateOptions:
        """These options validated, with --params and --tokens as the whole numbers the arithmetic counts in."""
        self.validate()
        return replace(self, params=_whole(self.params), tokens=_whole(self.tokens))


def _whole(count: float | None) -> int | None:
    return None if count is None else int(count)


def _gpu_figures(opts: EstimateOptions, precision: str) -> tuple[GPU, float, int, float]:
    gpu = get_gpu(opts.gpu)
    peak = opts.peak_tflops * 1e12 if opts.peak_tflops else gpu.peak_flops(precision)
    memory = opts.gpu_memory or gpu.memory_bytes
    price = gpu.usd_per_hour if opts.price_per_hour is None else opts.price_per_hour
    return gpu, peak, memory, price


def _run_precision(run: RunConfig | None) -> str:
    # `auto` means bf16 on a GPU, which is what an estimate is for.
    return "bf16" if run is None or run.train.precision == "auto" else run.train.precision


def estimate(run: RunConfig | None, opts: EstimateOptions) -> dict[str, Any]:
    """The whole report as a JSON-ready dict (the keys are documented in README.md)."""
    opts = opts.with_whole_counts()
    if run is None and opts.params is None:
        raise ConfigError("estimate needs a run directory or --params", "e.g. `nanopt estimate runs/gpt2-small`")
    precision = _run_precision(run)
    gpu, peak, gpu_memory, price = _gpu_figures(opts, precision)
    report: dict[str, Any] = {"run": str(run.run_dir) if run else None}
    report.update(_model_section(run, opts))
    report.update(_budget_section(run, opts, report))
    report.update(_time_section(report, opts, gpu, peak, price))
    report.update(_memory_section(run, opts, gpu_memory, precision, report["params"]))
    report.update(_batch_section(run, opts))
    return report


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


def _time_section(report: dict[str, Any], opts: EstimateOptions, gpu: GPU, peak: float,
                  price: float) -> dict[str, Any]:
    total_flops = report["train_tokens"] * report["flops_per_token"]
    seconds = flops.train_seconds(total_flops, opts.num_gpus, peak, opts.mfu)
    section: dict[str, Any] = {
        "total_flops": total_flops, "train_seconds": seconds, "train_hours": seconds / 3600,
        "cost_usd": seconds / 3600 * opts.num_gpus * price,
        "tokens_per_second": report["train_tokens"] / seconds,
        "gpu": {"key": gpu.key, "name": gpu.name, "peak_tflops": peak / 1e12,
                "peak_source": "--peak-tflops" if opts.peak_tflops else "dense table peak",
                "usd_per_hour": price, "num_gpus": opts.num_gpus, "mfu": opts.mfu},
        "hours": None,
    }
    if opts.hours:
        tokens = flops.tokens_in_seconds(opts.hours * 3600, report["flops_per_token"], opts.num_gpus, peak,
                                         opts.mfu)
        section["hours"] = {"hours": opts.hours, "tokens": tokens,
                            "fraction_of_chinchilla": tokens / report["chinchilla_tokens"],
                            "cost_usd": opts.hours * opts.num_gpus * price}
    return section


def _memory_section(run: RunConfig | None, opts: EstimateOptions, gpu_memory: int, precision: str,
                    params: int) -> dict[str, Any]:
    if run is None:
        states = memory_model.states_only(params)
        return {"memory_bytes": {**states.to_dict(0), "activations_per_sequence": None},
                "gpu_memory_bytes": gpu_memory, "max_micro_batch": None, "memory_assumptions": None}
    compiled = run.train.compile in (True, "auto")
    memory = memory_model.estimate_memory(
        run.model, run.seq_len, precision=precision, compiled=compiled,
        activation_checkpointing=run.train.activation_checkpointing, parallelism=run.train.parallelism,
        world_size=opts.num_gpus)
    return {"memory_bytes": memory.to_dict(run.train.micro_batch_size), "gpu_memory_bytes": gpu_memory,
            "max_micro_batch": memory.max_micro_batch(gpu_memory),
            "memory_assumptions": {"precision": precision, "compile": compiled,
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
