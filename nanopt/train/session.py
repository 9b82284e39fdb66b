"""A training session: dataset, model, parallel wrapping, optimizer, loader and state, built exactly as training
uses them. `nanopt find-batch` and `nanopt profile` build the same session to measure the real step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanopt.config import RunConfig
from nanopt.devices import MemoryProbe, check_memory, device_peak_flops, device_price
from nanopt.errors import ConfigError
from nanopt.model.flops import count_params, fp8_peak_label
from nanopt.model.memory import estimate_memory
from nanopt.rundir import RunDir
from nanopt.runtime import Runtime, seed_everything
from nanopt.train.observe.events import Silent, TrainObserver
from nanopt.train.observe.metrics import MetricsLog, SpikeMonitor
from nanopt.train.observe.pace import SlowdownWatch
from nanopt.train.observe.phases import EvalShareWatch, PhaseClock
from nanopt.train.observe.sinks import build_sinks, check_sink_packages
from nanopt.train.optim.optimizer import build_optimizer
from nanopt.train.parallel.graphed_step import check_cuda_graphs
from nanopt.train.parallel.world_fit import micro_batch_for_world
from nanopt.train.parallel.wrap import FSDP2_CHOICES, Prepared, prepare, resolve_compile, shards_optimizer_only
from nanopt.train.precision.fp8 import check_fp8
from nanopt.train.precision.residual import check_bf16_residual
from nanopt.train.precision.scaling import new_scaler
from nanopt.train.precision.weight_copies import check_bf16_weight_copies
from nanopt.train.shape_schedule import run_flops_per_token
from nanopt.train.state import Counters, TrainState


@dataclass(frozen=True)
class TrainOptions:
    resume: str = "auto"  # auto | none | latest | best | PATH
    allow_changed: bool = False  # resume although learning-rate, budget or world-size settings changed
    started: float | None = None  # Unix time the session is billed from: its process's start (the CLI); None: now
    # Scores train.json's downstream_tasks at each in-loop eval (nanopt.train.downstream.DownstreamHook); the CLI
    # builds it from nanopt.evaluate, which this layer cannot import. None: no downstream tasks.
    downstream: Any = None


@dataclass
class Session:
    run: RunConfig
    rt: Runtime
    opts: TrainOptions
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    dataset: Any
    accum: int
    total_steps: int
    metrics: MetricsLog
    observer: TrainObserver
    flops_per_token: float  # over the whole run: its sequence-length stages' weighted by their tokens
    peak_flops: float | None
    peak_source: str
    memory: MemoryProbe
    train_state: TrainState
    price_per_hour: float | None  # USD per device-hour (nanopt.devices.device_price), None where unknown
    price_source: str
    spikes: SpikeMonitor | None = None
    preempt_requested: bool = field(default=False)
    clock: PhaseClock = field(default_factory=PhaseClock)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # earlier sessions' phase records (rank 0)
    eval_watch: EvalShareWatch = field(default_factory=EvalShareWatch)
    spike_watch: Any = None  # nanopt.train.guard.recovery.SpikeWatch, set by the training loop when recovery is on
    pending_save: Any = None  # nanopt.train.checkpoint.save.PendingSave: the checkpoint being written in the background
    checkpoint_group: Any = None  # the gloo group checkpoints use beside training (made at the first save or load)
    # keeps the host copy of the state between saves (nanopt.train.checkpoint.save._stager)
    checkpoint_stager: Any = None
    downstream_last: tuple[int, float] | None = None  # (step, seconds) of the latest downstream scoring
    source_val_losses: dict[str, float] = field(default_factory=dict)  # a mixture's latest loss per source
    # nanopt.train.health.verdicts.HealthMonitor, set by the training loop when train.json `health` is on
    health: Any = None
    health_probe: Any = None  # nanopt.train.health.probe.HealthProbe, likewise
    health_signals: dict[str, Any] = field(default_factory=dict)  # the probe's last log step's fields
    # The pace of the log windows, to say once when other work has taken the machine (nanopt.train.observe.pace).
    slowdown: SlowdownWatch = field(default_factory=SlowdownWatch)

    @property
    def state(self) -> Counters:
        return self.train_state.counters

    @property
    def loader(self) -> Any:
        return self.train_state.loader

    @loader.setter
    def loader(self, loader: Any) -> None:
        self.train_state.loader = loader

    @property
    def paths(self) -> RunDir:
        return RunDir(self.run.run_dir)


def build_session(run: RunConfig, rt: Runtime, opts: TrainOptions | None = None, *, writes: bool = False,
                  observer: TrainObserver | None = None) -> Session:
    """Dataset, model, parallel wrapping, optimizer and loader at step 0, exactly as training uses them.

    With writes=False nothing is written into the run directory: `find-batch` and `profile` measure the real
    training step through this without touching a run's metrics or checkpoints. The observer hears from rank 0
    only. A budget beyond one pass over the train split is fine: the loader reshuffles each epoch, and the training
    loop warns that the data repeats.
    """
    from nanopt.data.dataset import VERIFY_AT_OPEN_BYTES, check_document_eos
    from nanopt.data.loaders.loader import check_compatible
    from nanopt.data.mixtures.mixture import open_run_data
    from nanopt.model.transformer import Transformer

    opts = opts or TrainOptions(resume="none")
    if writes:
        check_sink_packages(run)  # a missing tensorboard / wandb package is refused before any costly work
    memory = MemoryProbe(rt.device)  # before the model: it measures the CUDA context
    run, lowered = micro_batch_for_world(run, rt.world_size, opts.resume)
    accum = run.grad_accum_steps(rt.world_size)
    check_model_fits(run, rt)
    check_fp8(run, rt.device, rt.precision, resolve_compile(run.train.compile, rt.device))
    check_cuda_graphs(run, rt.device, rt.precision, rt.world_size)
    check_bf16_residual(run, rt.precision)
    check_bf16_weight_copies(run, rt.precision, run.train.parallelism in FSDP2_CHOICES and rt.distributed,
                             rt.world_size)
    # Training hashes a small dataset whole before it trusts it; find-batch and profile, which start a session per
    # trial or measurement and write nothing, check the cheap things only.
    dataset = open_run_data(run, verify_up_to_bytes=VERIFY_AT_OPEN_BYTES if writes else 0)
    check_compatible(dataset, run.model.vocab_size)
    check_document_eos(dataset, run.model)
    # Before the model, so a split without one whole sequence (or with a bad token id in the first step) fails
    # before any costly work. The loader draws nothing from the RNGs seeded below.
    loader = _train_loader(run, dataset, accum, rt)
    if rt.device.type == "cuda":
        # The next micro-batch is read into pinned memory in a background thread while this one trains, so its
        # copy to the GPU is a non-blocking DMA; on the CPU there is no device to overlap with. Set here, once, so
        # training, find-batch, profile and preflight (which wrap this loader to time it) all read the same way.
        loader.prefetch(pin_for=rt.device)
    seed_everything(run.train.seed)
    # The dataset's ids are the tokens: a model vocabulary padded past them keeps its padded rows out of the softmax.
    prepared = prepare(Transformer(run.model, tokenizer_vocab_size=dataset.id_limit), rt, run.train)
    optimizer = build_optimizer(prepared.raw, run.train, rt.device, shards_optimizer_only(run.train, rt))
    peak, source = device_peak_flops(rt.device, rt.precision, rt.tf32)
    source = fp8_peak_label(source, run.train.fp8)
    price, price_source = device_price(rt.device, run.train.price_per_hour)
    observer = observer if observer is not None and rt.is_main else Silent()
    if lowered:
        observer.note(lowered)
    sinks = build_sinks(run, observer.note) if rt.is_main and writes else None
    return Session(
        run=run, rt=rt, opts=opts, prepared=prepared, optimizer=optimizer, dataset=dataset, accum=accum,
        total_steps=run.total_steps, metrics=MetricsLog(run.run_dir, rt.is_main and writes, sinks),
        observer=observer,
        flops_per_token=run_flops_per_token(run), peak_flops=peak, peak_source=source,
        memory=memory, train_state=TrainState(loader, new_scaler(rt)), spikes=SpikeMonitor(run.train.spike_threshold),
        price_per_hour=price, price_source=price_source, clock=PhaseClock(opts.started or time.time()))


def _train_loader(run: RunConfig, dataset: Any, accum: int, rt: Runtime) -> Any:
    """The loader of the run's training data: a mixture's, one per sequence-length stage, or one TrainLoader
    (with batch warmup's batches). Stages refuse a mixture and a ramp, and a mixture refuses a ramp."""
    from nanopt.data.loaders.loader import TrainLoader
    from nanopt.data.loaders.staged_loader import StagedLoader
    from nanopt.data.mixtures.mixture import MixtureData, MixtureLoader

    args = ("train", run.seq_len, run.train.micro_batch_size, accum, rt.rank, rt.world_size, run.train.seed)
    if isinstance(dataset, MixtureData):
        return MixtureLoader(dataset, *args)
    if run.train.seq_len_stages is not None:
        return StagedLoader(dataset, "train", run.seq_stages, accum, rt.rank, rt.world_size, run.train.seed)
    return TrainLoader(dataset, *args, batch_ramp=run.train.batch_ramp)


OPTIMIZER_NAMES = {"adamw": "AdamW", "muon": "Muon and AdamW", "adamw8bit": "8-bit AdamW"}


def check_model_fits(run: RunConfig, rt: Runtime) -> None:
    """ConfigError, one line, when the model's fp32 weights, gradients and optimizer state alone (per rank, as
    `nanopt estimate` counts them) exceed this rank's device: each model.json dimension is bounded, their product
    is not, and a model of terabytes would otherwise fail in the allocator at the first tensor."""
    states = estimate_memory(run.model, run.seq_len, precision=rt.precision, compiled=False,
                             activation_checkpointing=run.train.activation_checkpointing,
                             parallelism=run.train.parallelism, world_size=rt.world_size,
                             optimizer=run.train.optimizer, cuda=rt.device.type == "cuda")
    what = (f"{RunDir(run.run_dir).model_json}: the model's weights, gradients and "
            f"{OPTIMIZER_NAMES[run.train.optimizer]} state ({count_params(run.model).total:,} parameters)")
    check_memory(states.weights + states.gradients + states.optimizer, rt.device, what, ConfigError,
                 "make the model smaller, or shard it over more GPUs with \"parallelism\": \"fsdp\" (`nanopt "
                 "estimate RUN` shows the memory per GPU)")
