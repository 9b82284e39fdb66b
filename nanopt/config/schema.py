"""The typed configs of train.json and of a run (TrainConfig, RunConfig; model.json's: nanopt.config.model_config):
every key, its type and range, what is derived from them (gradient accumulation, steps), and the checks that name
the file and the key of each mistake. Reading them from files and checkpoints: nanopt.config.load."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nanopt.config.batch_ramp import BatchRamp, check_batch_warmup, ramp_of
from nanopt.config.checks import check_non_negative, check_positive, check_range
from nanopt.config.mixture import Mixture, resolve_mixture, wsd_decay_start
from nanopt.config.model_config import ModelConfig
from nanopt.config.no_data import check_has_data
from nanopt.config.seq_stages import SeqStage, check_alone, resolve_stages
from nanopt.errors import ConfigError
from nanopt.hardware import MAX_PRICE_PER_HOUR
from nanopt.parsing import plain_path, show_value

Schedule = Literal["cosine", "wsd", "constant"]
Precision = Literal["auto", "bf16", "fp16", "fp32"]
Parallelism = Literal["ddp", "zero1", "zero2", "fsdp", "fsdp_offload"]  # nanopt.train.parallel.wrap
# false, true (every block), k (every k-th block) or "selective" (nanopt.train.parallel.recompute)
ActivationCheckpointing = bool | int | Literal["selective"]
OptimizerName = Literal["adamw", "muon", "adamw8bit"]
CompileMode = bool | Literal["auto"]
WandbMode = Literal["online", "offline"]
Fp8Mode = Literal["off", "head", "all"]

# Every integer in these files fits in 64 bits: torch and numpy hold them as int64, and past that they fail with a
# traceback (or wrap around) far from the file that caused it.

# train.json keys that count tokens: also written as people write counts ("2.5B", "500M", "20e9"), as --max-tokens is.
TOKEN_COUNT_KEYS = ("train_tokens", "eval_tokens", "global_batch_tokens", "batch_warmup_tokens",
                    "batch_warmup_start_tokens")
# The budget is one or the other.
BUDGET_KEYS = ("train_tokens", "max_steps")


@dataclass(frozen=True)
class TrainConfig:
    """Data, batch, optimizer, schedule, eval, checkpoint and runtime settings of a run."""

    # The dataset directory made by `nanopt tokenize` (relative to the run directory unless absolute), or a mixture
    # of several with weights, optionally changed by data_phases (nanopt.config.mixture).
    data: str | dict[str, Any]
    micro_batch_size: int
    global_batch_tokens: int  # tokens per optimizer step across all ranks
    train_tokens: int | None = None  # token budget; or give max_steps
    max_steps: int | None = None
    seq_len: int | None = None  # default: the model's max_position_embeddings
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1  # final LR as a fraction of the peak (cosine and WSD)
    lr_schedule: Schedule = "cosine"
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # WSD: the last fraction of steps decays to the minimum
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 250  # steps; 0 disables in-loop eval
    eval_tokens: int = 1_048_576
    # Downstream tasks scored at in-loop evals (`nanopt eval --tasks` names, comma-separated; None: off), every
    # downstream_interval steps (None: eval_interval; a multiple of it; 0: never), on the first downstream_examples
    # examples of each, from the hub or downstream_task_data (a --task-data folder).
    downstream_tasks: str | None = None
    downstream_interval: int | None = None
    downstream_examples: int = 500
    downstream_task_data: str | None = None
    checkpoint_interval: int = 500  # steps; the last step always checkpoints
    keep_checkpoints: int = 3
    # Write checkpoints in the background, keeping one host copy of each rank's state between saves; false: the
    # step waits for every save, and the host copy is freed after each.
    checkpoint_async: bool = True
    log_interval: int = 10
    health: bool = True  # health signals at log steps and their verdicts (nanopt.train.health.verdicts)
    seed: int = 1337
    precision: Precision = "auto"  # auto: bf16 on CUDA with bf16 support, else fp32
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores; false: true fp32 (a reference for bf16 runs)
    compile: CompileMode = "auto"  # auto: on for CUDA, off on the CPU
    # One GPU: each micro-batch's forward and backward replayed from a CUDA graph captured once
    # (nanopt.train.parallel.graphed_step), which removes the host's launch gaps between kernels. Off until a GPU
    # window measures it.
    cuda_graphs: bool = False
    # bf16: the residual stream between blocks kept in bf16 instead of fp32 (norms still compute in fp32): less
    # memory and traffic, each residual addition rounded to bf16. Changes the numerics: opt-in.
    bf16_residual: bool = False
    # bf16: the blocks' linear layers compute from bf16 copies of their weights made once per optimizer step instead
    # of a cast per micro-batch, and their weight gradients come out of the GEMM in fp32 where the GPU allows
    # (nanopt.train.precision.weight_copies). The same numbers on the CPU; off until a GPU window measures it.
    bf16_weight_copies: bool = False
    # FP8 matmuls (GPUs with FP8 tensor cores, bf16): "head", the output head in the loss; "all", also the blocks'
    # larger linear layers through torchao (nanopt.train.precision.fp8). Weights and checkpoints are the same either
    # way.
    fp8: Fp8Mode = "off"
    activation_checkpointing: ActivationCheckpointing = False
    parallelism: Parallelism = "ddp"
    optimizer: OptimizerName = "adamw"  # muon: Muon on the hidden matrices, AdamW (learning_rate) on the rest
    muon_learning_rate: float = 0.02  # Muon's peak LR; the schedule scales it by the same factor as learning_rate
    max_nonfinite_steps: int = 5  # consecutive skipped non-finite steps before training stops
    spike_threshold: float = 6.0  # loss-spike report: this many standard deviations above the rolling mean
    # Automatic recovery (nanopt.train.guard.recovery): on a confirmed spike or divergence, roll back to the newest
    # checkpoint before it, skip past the data being read, lower the learning rate and ramp it back, go on.
    recovery: bool = True
    recovery_confirm_steps: int = 3  # consecutive spiking steps (spike_threshold) that confirm a spike
    recovery_skip_steps: int = 10  # extra steps' worth of batches skipped beyond those read since the checkpoint
    recovery_lr_factor: float = 0.5  # the learning rate is multiplied by this right after a rollback ...
    recovery_lr_steps: int = 200  # ... and ramps back linearly to the schedule's over this many steps
    max_recoveries: int = 3  # rollbacks per run; one more confirmed spike or divergence stops training
    price_per_hour: float | None = None  # USD per GPU-hour for live cost; default: the GPU table's price, if known
    on_exit: str | None = None  # a shell command rank 0 runs once when the run ends, for any reason
    on_exit_timeout_s: float = 300.0  # the on_exit command is stopped after this many seconds
    # no progress for this long after the first step: reported (nanopt.train.guard.stall)
    stall_timeout_s: float = 1800.0
    # also log every metrics.jsonl record to runs/NAME/tensorboard/ (nanopt.train.observe.sinks)
    tensorboard: bool = False
    wandb_project: str | None = None  # a W&B project name turns Weights & Biases logging on
    wandb_mode: WandbMode | None = None  # default: online with an API key (or `wandb login`), else offline
    data_phases: list[Any] | None = None  # a mixture per phase: [{"from": 0.9 | STEP | "decay", "mixture": {...}}]
    data_epochs_warning: float = 4.0  # warn at start-up when a mixture's source would be read more often than this
    # Batch-size warmup (nanopt.config.batch_ramp): the global batch starts at batch_warmup_start_tokens and grows
    # in whole multiples of it to global_batch_tokens over the first batch_warmup_tokens tokens. None: off.
    batch_warmup_tokens: int | None = None
    batch_warmup_start_tokens: int | None = None
    # Sequence-length stages (nanopt.config.seq_stages): [{"from": 0.9, "seq_len": 4096}] trains at seq_len, then at
    # 4096 from 90% of the run on, a micro-batch keeping its tokens. None: seq_len throughout.
    seq_len_stages: list[Any] | None = None

    def validate(self, model: ModelConfig, source: str = "train.json", *, look_up_data: bool = True) -> None:
        # look_up_data False (a checkpoint's snapshot): the dataset it named may be gone now, without harm to it
        if isinstance(self.data, str):
            _check_dataset_path(self.data, source, look_up_data)
        check_positive(self, source, ("micro_batch_size", "global_batch_tokens", "eval_tokens", "downstream_examples",
                                       "keep_checkpoints",
                                       "log_interval", "max_nonfinite_steps", "adam_eps", "spike_threshold",
                                       "recovery_confirm_steps", "max_recoveries", "data_epochs_warning"))
        check_non_negative(self, source, ("warmup_steps", "eval_interval", "checkpoint_interval", "grad_clip",
                                           "weight_decay", "seed", "recovery_skip_steps", "recovery_lr_steps"))
        self._check_downstream_interval(source)
        if not (math.isfinite(self.recovery_lr_factor) and 0 < self.recovery_lr_factor <= 1):
            raise ConfigError(f"{source}: key 'recovery_lr_factor': {show_value(self.recovery_lr_factor)} is outside "
                              "(0, 1]", "the learning-rate multiplier after a rollback, e.g. 0.5")
        if (self.train_tokens is None) == (self.max_steps is None):
            raise ConfigError(f"{source}: give exactly one of 'train_tokens' and 'max_steps'",
                              "e.g. \"train_tokens\": \"2.48B\" (the Chinchilla budget: `nanopt estimate`); "
                              "--set train_tokens=N alone replaces train.json's max_steps, and the reverse")
        for key in ("train_tokens", "max_steps"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"{source}: key '{key}': must be positive, got {value}", "use a positive number")
        if self.seq_len is not None and self.seq_len <= 0:
            raise ConfigError(f"{source}: key 'seq_len': must be positive, got {self.seq_len}", "e.g. 1024")
        if self.resolved_seq_len(model) > model.max_position_embeddings:
            raise ConfigError(
                f"{source}: key 'seq_len': {self.seq_len} exceeds the model's max_position_embeddings "
                f"{model.max_position_embeddings}", "lower seq_len or raise max_position_embeddings in model.json")
        if self.learning_rate <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{source}: key 'learning_rate' / 'min_lr_ratio': need learning_rate > 0 and "
                              f"0 <= min_lr_ratio <= 1", "e.g. 6e-4 and 0.1")
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"{source}: key 'decay_fraction': {self.decay_fraction} is outside (0, 1]", "e.g. 0.2")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{source}: key '{key}': {getattr(self, key)} is outside [0, 1)", "e.g. 0.9, 0.95")
        tokens_per_micro = self.micro_batch_size * self.resolved_seq_len(model)
        if self.global_batch_tokens < tokens_per_micro:
            raise ConfigError(
                f"{source}: key 'global_batch_tokens': {self.global_batch_tokens} is smaller than one micro-batch "
                f"({self.micro_batch_size} x {self.resolved_seq_len(model)} = {tokens_per_micro} tokens)",
                f"raise it to a multiple of {tokens_per_micro} or lower micro_batch_size")

        self._check_optimizer(source)
        check_batch_warmup(self.batch_warmup_start_tokens, self.batch_warmup_tokens, self.global_batch_tokens,
                           self.micro_batch_size * self.resolved_seq_len(model), isinstance(self.data, dict), source)
        check_alone(self.seq_len_stages, self.batch_ramp is not None, isinstance(self.data, dict), source)
        self.seq_stages(model, source)
        for item in (self.mixture(source).sources if isinstance(self.data, dict) else ()):
            _check_dataset_path(item.path, source, look_up_data)
        check_range(self, source, "price_per_hour", 0, MAX_PRICE_PER_HOUR, "USD per GPU-hour, e.g. 2.99")
        check_range(self, source, "on_exit_timeout_s", 1, 86_400, "seconds, e.g. 300")
        check_range(self, source, "stall_timeout_s", 0, 7 * 86_400, "seconds, e.g. 1800 (0: no stall watch)")
        if self.on_exit is not None and not self.on_exit.strip():
            raise ConfigError(f"{source}: key 'on_exit': the command is empty",
                              "give a shell command such as \"sudo shutdown -h now\", or remove the key")
        _check_wandb_project(self.wandb_project, source)

    def _check_downstream_interval(self, source: str) -> None:
        """Tasks are scored at in-loop evaluations: their interval is a multiple of eval_interval. With eval_interval
        0 nothing is evaluated, so no task is scored whatever this says (a preset's interval then needs no edit)."""
        every, evals = self.downstream_interval, self.eval_interval
        if every is None or every == 0:
            return
        if every < 0:
            raise ConfigError(f"{source}: key 'downstream_interval': must not be negative, got {every}",
                              "use a multiple of eval_interval, or 0 for none")
        if evals and every % evals:
            raise ConfigError(f"{source}: key 'downstream_interval': {every} is not a multiple of eval_interval "
                              f"{evals}", "downstream tasks are scored at in-loop evaluations: use a multiple of "
                              f"eval_interval (e.g. {max(evals, 1) * 4}), or 0 for none")

    def _check_optimizer(self, source: str) -> None:
        checkpointing = self.activation_checkpointing
        if type(checkpointing) is int and checkpointing < 1:
            raise ConfigError(f"{source}: key 'activation_checkpointing': {checkpointing} is not a block interval",
                              "use false, true, \"selective\" or k >= 1 (every k-th block)")
        if self.optimizer == "adamw8bit" and self.parallelism == "zero1":
            raise ConfigError(f"{source}: \"optimizer\": \"adamw8bit\" does not run with \"parallelism\": \"zero1\" "
                              "(ZeroRedundancyOptimizer steps a torch optimizer per rank, and nanopt does not convert "
                              "its state to torchao's 8-bit moments)", "use \"zero2\", which shards the 8-bit moments "
                              "and the gradients too, or \"ddp\"")
        if self.optimizer == "muon" and self.parallelism in ("zero1", "fsdp_offload"):
            raise ConfigError(f"{source}: \"optimizer\": \"muon\" does not run with \"parallelism\": "
                              f"\"{self.parallelism}\"", "use \"ddp\", \"zero2\" or \"fsdp\" with muon, or adamw")
        if not (math.isfinite(self.muon_learning_rate) and self.muon_learning_rate > 0):
            raise ConfigError(f"{source}: key 'muon_learning_rate': must be positive, got {self.muon_learning_rate}",
                              "e.g. 0.02 (Muon's usual peak LR)")

    @property
    def batch_ramp(self) -> BatchRamp | None:
        """The batch of every step under batch warmup; None when the batch is global_batch_tokens throughout."""
        if self.batch_warmup_tokens is None or self.batch_warmup_start_tokens is None:
            return None
        return ramp_of(self.batch_warmup_start_tokens, self.global_batch_tokens, self.batch_warmup_tokens)

    def tokens_before(self, step: int) -> int:
        """Tokens trained by the optimizer steps before `step`."""
        ramp = self.batch_ramp
        return step * self.global_batch_tokens if ramp is None else ramp.tokens_before(step)

    @property
    def total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        ramp = self.batch_ramp
        if ramp is not None:
            return ramp.steps_for(self.train_tokens)
        return math.ceil(self.train_tokens / self.global_batch_tokens)

    def mixture(self, source: str = "train.json") -> Mixture | None:
        """`data` and `data_phases` as a mixture with its phases placed on steps; None for one dataset."""
        decay = (wsd_decay_start(self.total_steps, self.warmup_steps, self.decay_fraction)
                 if self.lr_schedule == "wsd" else None)
        return resolve_mixture(self.data, self.data_phases, self.total_steps, decay, source)

    def seq_stages(self, model: ModelConfig, source: str = "train.json") -> tuple[SeqStage, ...]:
        """The run's sequence-length stages, train.json's seq_len from step 0 first (alone without stages)."""
        return resolve_stages(self.seq_len_stages, self.resolved_seq_len(model), self.micro_batch_size,
                              self.total_steps, model.max_position_embeddings, source)

    def resolved_seq_len(self, model: ModelConfig) -> int:
        return self.seq_len if self.seq_len is not None else model.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunConfig:
    """Both files of a run directory, validated together, with the values derived from them."""

    run_dir: Path
    model: ModelConfig
    train: TrainConfig
    set_on_command_line: frozenset[str] = frozenset()  # train.json's keys `--set` gave, for messages to name

    @property
    def seq_len(self) -> int:
        return self.train.resolved_seq_len(self.model)

    @property
    def seq_stages(self) -> tuple[SeqStage, ...]:
        """The sequence-length stages, the base (seq_len, from step 0) first; one without seq_len_stages."""
        return self.train.seq_stages(self.model, str(self.run_dir / "train.json"))

    @property
    def data_dir(self) -> Path:
        """The dataset directory. A relative `data` is relative to the run directory, not to wherever the command
        runs, so `nanopt train/eval/export runs/NAME` find the same dataset from any working directory. A mixture's
        first source (all share one tokenizer); data_dirs has them all."""
        return self.data_dirs[0]

    @property
    def data_dirs(self) -> list[Path]:
        """Every dataset directory `data` names: one, or a mixture's in train.json's order; ConfigError for an
        imported run's placeholder (nanopt.config.no_data)."""
        check_has_data(self.train.data, self.run_dir)
        mixture = self.train.mixture()
        paths = [self.train.data] if mixture is None else [item.path for item in mixture.sources]
        return [plain_path(self.run_dir / path) for path in paths]  # an absolute path stays as it is

    @property
    def mixture(self) -> Mixture | None:
        return self.train.mixture(str(self.run_dir / "train.json"))

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.train.micro_batch_size * self.seq_len

    def sequences_per_rank(self, world_size: int = 1) -> float:
        """Sequences of seq_len each rank trains in one optimizer step (the global batch over seq_len x world
        size): a micro-batch smaller than this accumulates, and its gradients live through the later forwards."""
        return self.train.global_batch_tokens / (self.seq_len * world_size)

    def grad_accum_steps(self, world_size: int = 1) -> int:
        """Micro-steps per optimizer step: global batch / (micro batch x seq_len x world size), exactly."""
        if world_size < 1:  # a launcher count of 0 or less; dividing by it would be a ZeroDivisionError or worse
            raise ConfigError(f"world size {world_size}: a run needs at least one rank",
                              "--nproc-per-node and --nnodes are each at least 1")
        per_step = self.tokens_per_micro_batch * world_size
        accum, remainder = divmod(self.train.global_batch_tokens, per_step)
        if remainder or accum == 0:
            raise ConfigError(
                f"train.json: key 'global_batch_tokens': {self.train.global_batch_tokens} is not a multiple of "
                f"micro_batch_size x seq_len x world_size = {self.train.micro_batch_size} x {self.seq_len} x "
                f"{world_size} = {per_step}",
                _batch_suggestions(self.train.global_batch_tokens, self.seq_len, world_size,
                                   self.train.micro_batch_size))
        if self.train.batch_ramp is not None:
            check_batch_warmup(self.train.batch_warmup_start_tokens, self.train.batch_warmup_tokens,
                               self.train.global_batch_tokens, per_step, False, "train.json",
                               f"micro_batch_size x seq_len x world_size = {self.train.micro_batch_size} x "
                               f"{self.seq_len} x {world_size}")
        return accum

    @property
    def total_steps(self) -> int:
        return self.train.total_steps

    @property
    def total_tokens(self) -> int:
        return self.train.tokens_before(self.total_steps)

    def snapshot(self) -> dict[str, Any]:
        """The full config, as stored in checkpoints to detect a changed run on resume."""
        return {"model": self.model.to_dict(), "train": self.train.to_dict()}


def _batch_suggestions(global_tokens: int, seq_len: int, world: int, micro: int) -> str:
    unit = seq_len * world
    micros = [m for m in range(1, 4 * micro + 1) if global_tokens % (m * unit) == 0][-4:]
    lower = (global_tokens // (micro * unit)) * micro * unit
    upper = lower + micro * unit
    options = [f"global_batch_tokens {t}" for t in (lower, upper) if t > 0]
    if micros:
        options.append("micro_batch_size " + " or ".join(str(m) for m in micros))
    return "values that work: " + ", or ".join(options)


def _check_wandb_project(project: str | None, source: str) -> None:
    """W&B refuses these project names, but only once training has started: say so before."""
    if project is not None and (not project.strip() or len(project) > 128 or any(c in project for c in "/\\#?%:")):
        raise ConfigError(f"{source}: key 'wandb_project': {show_value(project)} is not a W&B project name",
                          "use up to 128 characters without / \\ # ? % :, e.g. \"nanopt\"; null turns W&B off")


def _check_dataset_path(data: str, source: str, look_up: bool = True) -> None:
    """A `data` value the operating system cannot even look up (empty, a NUL byte, a name too long) is a typo in
    train.json, not a missing dataset: say so here rather than fail inside a path lookup."""
    problem = "is empty" if not data.strip() else None
    if problem is None and not look_up and "\0" in data:  # what the lookup below would refuse
        problem = "holds a NUL byte"
    if problem is None and look_up:
        try:
            os.stat(data)
        except FileNotFoundError:
            pass  # a missing dataset is reported when the dataset is opened, with how to make it
        except (OSError, ValueError) as exc:  # ENAMETOOLONG, ELOOP, EACCES ...; ValueError: embedded NUL byte
            problem = f"is not a usable path ({getattr(exc, 'strerror', None) or exc})"
    if problem:
        raise ConfigError(f"{source}: key 'data': {show_value(data)} {problem}",
                          "give the dataset directory made by `nanopt tokenize`, e.g. \"data/stdlib\"")
