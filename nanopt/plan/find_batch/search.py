"""The search itself and what a size's outcome means: options, trials, bisection, rank agreement, judging.

Pure: no torch at import, no processes; `search` is tested as a function of a predicate.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanopt.config import RunConfig, TrainConfig
from nanopt.config.seq_stages import whole_in_every_stage
from nanopt.errors import ConfigError
from nanopt.hardware import MAX_SIZE_BYTES
from nanopt.parsing import check_option
from nanopt.train.shape_schedule import longest_stage_run

DEFAULT_MAX = 1024
MIN_STEPS = 3
LOG_EVERY = 2  # a trial's log steps (trial_run): one within MIN_STEPS, and a step after it that is not one
MAX_MICRO_BATCH = 1 << 20
MAX_TRIAL_STEPS = 10_000
MAX_TRIAL_TIMEOUT_S = 7 * 24 * 3600.0  # a week
# Enough to double from 1 to 1024 and bisect back (21), so a bound that stops a search is a choice, not an accident.
DEFAULT_MAX_TRIALS = 24
# From the memory model's prediction the answer is near: first steps of 25% (not 2x) until a size fails or fits.
PREDICTED_GROWTH = 1.25
ISOLATIONS = ("auto", "process", "in-process")

@dataclass(frozen=True)
class FindBatchOptions:
    start: int | None = 1  # None: the memory model's prediction for this device
    maximum: int = DEFAULT_MAX
    steps: int = MIN_STEPS
    margin: float = 0.05  # keep this fraction of the limit free
    gpu_memory: int | None = None  # bytes: behave as if the GPU had this much memory
    max_memory: int | None = None  # bytes, CPU only: bound on a trial process's peak resident memory
    trial_timeout_s: float = 1800.0
    max_trials: int = DEFAULT_MAX_TRIALS
    isolation: str = "auto"  # where a single-process search runs its trials: see trials_in_process

    def validate(self) -> None:
        # Upper bounds far past any real search: a value beyond one is a typo (and a trial asked for 2**63 steps
        # or sequences would run or allocate until killed).
        hint = f"need 1 <= --start <= --max, --steps >= {MIN_STEPS}, 0 <= --margin < 1"
        check_option("--start", self.start, 1, MAX_MICRO_BATCH, hint)
        check_option("--max", self.maximum, self.start or 1, MAX_MICRO_BATCH, hint)
        check_option("--max-trials", self.max_trials, 1, MAX_TRIAL_STEPS, "e.g. --max-trials 8")
        if self.isolation not in ISOLATIONS:
            raise ConfigError(f"--isolation: unknown value '{self.isolation}'",
                              "use --isolation auto, --isolation process or --isolation in-process")
        check_option("--steps", self.steps, MIN_STEPS, MAX_TRIAL_STEPS, hint)
        check_option("--margin", self.margin, 0, 0.99, hint)
        check_option("--gpu-memory", self.gpu_memory, 1, MAX_SIZE_BYTES, hint)
        check_option("--max-memory", self.max_memory, 1, MAX_SIZE_BYTES, hint)
        check_option("--timeout", self.trial_timeout_s, 0, MAX_TRIAL_TIMEOUT_S, "seconds, e.g. 1800",
                     above_low=True)


@dataclass
class Trial:
    micro_batch_size: int
    fits: bool
    reason: str  # fits | OOM | over limit | predicted OOM | killed by SIGKILL | crashed: ... | timed out
    peak_memory_bytes: int | None
    tokens_per_s: float | None
    mfu: float | None
    mfu_note: str | None  # why mfu is None although the GPU's peak is known (nanopt.model.flops.mfu_note)
    step_time_s: float | None
    grad_accum: int | None  # for the configured global batch; None where it does not divide exactly
    peak_is_lower_bound: bool = False  # the trial was stopped once over the bound: its true peak is higher
    predicted_peak_bytes: int | None = None
    peak_error: float | None = None  # (predicted - measured) / measured


# ------------------------------------------------------------------------------------------------- search


class _OutOfTrials(Exception):
    """The search has used all the trials it may."""


Step = Callable[[int, float], int]  # (a size, the factor) -> the next size to try, up or down


def _up(size: int, factor: float) -> int:
    return max(size + 1, int(size * factor))


def _down(size: int, factor: float) -> int:
    return max(1, min(size - 1, int(size / factor)))


def search(fits: Callable[[int], bool], start: int = 1, maximum: int = DEFAULT_MAX, max_trials: int | None = None,
           growth: float = 2.0, up: Step = _up, down: Step = _down) -> tuple[int, list[int]]:
    """The largest n in [1, maximum] with fits(n), for a predicate that holds up to a threshold and not above.

    From `start`, steps up by `growth` while sizes fit (until `maximum`), or down by it while they fail (until 1),
    then bisects between the last size that fit and the first that failed. Each size is tried once, at most
    `max_trials` sizes in all: when they run out, the answer is the largest size that fit so far. `up` and `down`
    give the next size of a step (search_among's walk a grid of sizes).
    Returns (the largest size that fits, or 0, and the sizes in the order they were tried).
    """
    if not 1 <= start <= maximum:
        raise ValueError(f"need 1 <= start <= maximum, got start {start}, maximum {maximum}")
    outcomes: dict[int, bool] = {}  # in the order tried

    def attempt(size: int) -> bool:
        if max_trials is not None and len(outcomes) >= max_trials:
            raise _OutOfTrials
        outcomes[size] = fits(size)
        return outcomes[size]

    try:
        fit, fail = _bracket(attempt, start, maximum, growth, up, down)
        while fail - fit > 1:
            middle = (fit + fail) // 2
            if attempt(middle):
                fit = middle
            else:
                fail = middle
    except _OutOfTrials:
        # Every size tried above the largest that fit failed (the bracket only narrows), so that one is the answer.
        fit = max((size for size, ok in outcomes.items() if ok), default=0)
    return fit, list(outcomes)


def _bracket(attempt: Callable[[int], bool], start: int, maximum: int, growth: float, up: Step,
             down: Step) -> tuple[int, int]:
    """(a size that fits or 0, a larger size that fails, or maximum + 1 when maximum fits), stepping from `start`.
    Each step is `growth` times larger than the last, up to 2x: a prediction far off costs a few trials more than
    doubling would, a close one far fewer."""
    factor = growth
    if attempt(start):
        fit = start
        while fit < maximum:
            size = min(up(fit, factor), maximum)
            if not attempt(size):
                return fit, size
            fit, factor = size, min(2.0, factor * growth)
        return fit, maximum + 1
    fail = start
    while fail > 1:
        size = down(fail, factor)
        if attempt(size):
            return size, fail
        fail, factor = size, min(2.0, factor * growth)
    return 0, fail


def search_among(fits: Callable[[int], bool], sizes: list[int], start: int, max_trials: int | None = None,
                 growth: float = 2.0) -> tuple[int, list[int]]:
    """`search` over the ascending `sizes` only, from the largest size <= start (else the smallest). A step goes to
    the usable size nearest (in ratio) to `growth` times the last one, at least the next size: steps are in sizes,
    not in their positions. From a prediction of 188 the search tries 128, then 256, not 512 (position 8 x 1.25 =
    10), which cost the third H100 window's search a trial. It bisects over positions. Returns (the largest size
    that fits, or 0, and the sizes in the order tried)."""
    first = max(1, bisect.bisect_right(sizes, start))

    def nearest(target: float) -> int:  # the position of the size nearest target in ratio
        above = min(bisect.bisect_left(sizes, target), len(sizes) - 1)
        below = max(above - 1, 0)
        return 1 + min((below, above), key=lambda i: abs(math.log(sizes[i] / target)))

    def up(position: int, factor: float) -> int:
        return max(position + 1, nearest(sizes[position - 1] * factor))

    def down(position: int, factor: float) -> int:
        return max(1, min(position - 1, nearest(sizes[position - 1] / factor)))

    found, tried = search(lambda position: fits(sizes[position - 1]), first, len(sizes), max_trials, growth, up, down)
    return (sizes[found - 1] if found else 0), [sizes[position - 1] for position in tried]


def usable_micro_batches(train: TrainConfig, seq_len: int, world_size: int, maximum: int) -> list[int]:
    """The micro-batch sizes up to `maximum` the run can use: those that divide its global batch exactly (a whole
    accumulation), ascending. ConfigError when none can, because the global batch is not a whole number of
    sequences per rank: then no search could find one."""
    # Under batch warmup its first, smallest batch, which every later one is a multiple of.
    key = "global_batch_tokens" if train.batch_ramp is None else "batch_warmup_start_tokens"
    batch = getattr(train, key)
    sequences, remainder = divmod(batch, seq_len * world_size)
    if remainder or sequences < 1:
        multiple = seq_len * world_size
        raise ConfigError(f"train.json: {key} {batch:,} is not a multiple of "
                          f"seq_len x world size = {seq_len} x {world_size}: no micro-batch divides it",
                          f"set {key} to a multiple of {multiple:,}, e.g. "
                          f"{max(1, round(batch / multiple)) * multiple:,}")
    # Under sequence-length stages a micro-batch keeps its tokens: it must be whole sequences of every stage's length.
    lengths = [stage["seq_len"] for stage in train.seq_len_stages or ()]
    return [n for n in range(1, min(sequences, maximum) + 1)
            if sequences % n == 0 and whole_in_every_stage(n, seq_len, lengths)]


def agree(rt: Any, fits_local: bool) -> bool:
    """Whether a size fits on every rank: an all-reduce MIN, entered by every rank after every trial."""
    if not rt.distributed:
        return fits_local
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if fits_local else 0], dtype=torch.int32, device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def grad_accum_for(train: TrainConfig, micro_batch_size: int, seq_len: int, world_size: int) -> int | None:
    """Accumulation steps the configured global batch needs at this micro-batch; None if it does not divide (or,
    under batch warmup, does not divide its first batch)."""
    per_step = micro_batch_size * seq_len * world_size
    accum, remainder = divmod(train.global_batch_tokens, per_step)
    whole_ramp = train.batch_ramp is None or train.batch_warmup_start_tokens % per_step == 0
    return accum if accum >= 1 and remainder == 0 and whole_ramp else None


def trial_run(run: RunConfig, micro_batch_size: int, world_size: int) -> RunConfig:
    """The run with `micro_batch_size`, stepping as the run will at that size: two micro-batches a step where the
    run accumulates, one where it does not. Accumulating, the gradients stay allocated while the later
    micro-batches run forward (4 bytes a parameter, 4.6 GiB on a 1B model: more than the margin), so a trial of
    one micro-batch a step would pass sizes that run out of memory in training. Two show that peak; more would
    only repeat it. Every second step is a log step, whose update holds run health's copy of the weights (the
    trial's at least 3 steps: step 2 measures it, step 3 times a step as most steps are). Under
    sequence-length stages the trial runs the longest stage's shape (the same tokens a micro-batch, the largest
    attention): the size that fits there fits the whole run."""
    accumulation = 2 if micro_batch_size < run.sequences_per_rank(world_size) else 1
    train = dataclasses.replace(run.train, micro_batch_size=micro_batch_size,
                                global_batch_tokens=micro_batch_size * run.seq_len * world_size * accumulation,
                                batch_warmup_tokens=None, batch_warmup_start_tokens=None,  # same micro-batch
                                log_interval=LOG_EVERY)
    return longest_stage_run(dataclasses.replace(run, train=train))


# ----------------------------------------------------------------------------------------------- judging


def usable_bytes(limit: int | None, margin: float) -> int | None:
    return None if limit is None else int((1 - margin) * limit)


def memory_limit(opts: FindBatchOptions, device_memory_bytes: int | None) -> int | None:
    """The memory a trial may use before the margin: --gpu-memory, the GPU's memory, or (CPU) --max-memory.
    None only on a GPU before any trial has reported the device's memory."""
    if opts.gpu_memory is not None:
        return opts.gpu_memory
    if device_memory_bytes is not None:
        return device_memory_bytes
    return opts.max_memory


def judge(m: dict[str, Any], limit: int | None, margin: float) -> tuple[bool, str]:
    """(fits, reason) for one measurement against the limit less the margin."""
    status = m["status"]
    if status == "ok":
        usable = usable_bytes(limit, margin)
        over = usable is not None and m["peak_memory_bytes"] > usable
        return (False, "over limit") if over else (True, "fits")
    reasons = {"oom": "OOM", "over_limit": "over limit", "predicted_oom": "predicted OOM (not run)",
               "timeout": "timed out"}
    if status in reasons:
        return False, reasons[status]
    detail = m.get("detail", "")
    if detail.startswith("oom: "):
        return False, "OOM"
    return False, detail if status == "died" else f"crashed: {detail}"




def trials_in_process(isolation: str, cuda: bool, compiled: bool) -> bool:
    """Whether a single-process search runs its trials in its own process rather than one process per trial.

    auto: in-process on a GPU without compile, where an OOM raises torch.OutOfMemoryError, the trial's memory is
    freed and the next trial starts from an emptied cache; every trial saves a new CUDA context. A process per
    trial with compile (a failed compilation or autotuning can leave state behind, and dynamo's caches grow with
    every size) and on the CPU (nothing raises there: the parent watches the trial's memory and kills it once over
    --max-memory, before it takes the machine down)."""
    if isolation != "auto":
        return isolation == "in-process"
    return cuda and not compiled
