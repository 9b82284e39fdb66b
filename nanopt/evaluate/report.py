"""Evaluate a trained checkpoint: loss, perplexity and bits per byte on the held-out test split, plus samples.

The test split is never read by training (train split) or its in-loop evaluation (val split), so its loss is the
number to compare runs by. It is measured on a fixed slice: the split's first `tokens` targets (every token but
the first with `all`, or when the split is smaller), cut into the loader's seq_len windows, the last one partial, so
every evaluation of a checkpoint scores the same tokens on any number of ranks and any micro-batch size (see
nanopt.data.loaders.loader.eval_batches). The result says how many tokens were scored, of how many in the split.

Bits per byte = loss (nats per token) / ln 2 / (UTF-8 bytes per token of the split). It does not depend on the
tokenizer, so it compares runs whose tokenizers differ; loss and perplexity only compare runs sharing one.

The checkpoint is opened by nanopt.evaluate.trained; samples come from nanopt.evaluate.samples.

Rank 0 writes the result atomically to checkpoints/step-N/eval.json and, as the run's latest evaluation, to
runs/NAME/eval.json.
"""

from __future__ import annotations

import datetime
import json
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nanopt.config import MAX_MODEL_DIMENSION
from nanopt.data.loaders.loader import EVAL_SLICE_VERSION
from nanopt.data.mixtures.mixture import run_eval_batches
from nanopt.errors import CheckpointError, ConfigError, WritePathError
from nanopt.evaluate.compare import training_record
from nanopt.evaluate.history import append_result
from nanopt.evaluate.reuse import NotReusable, measured, previous_result
from nanopt.evaluate.samples import SampleSettings, check_prompts_fit, generate_samples
from nanopt.evaluate.tasks.downstream import TaskOptions
from nanopt.evaluate.tasks.harness import HarnessOptions
from nanopt.evaluate.trained import TrainedModel, fallback_note, load_model, open_trained, tokenizer_identity
from nanopt.files import check_run_dir
from nanopt.parsing import INT64_MAX, check_option, save_json
from nanopt.rundir import CHECKPOINTS, EVAL_FILE, RunDir
from nanopt.runtime import (
    Runtime,
    barrier,
    broadcast_object,
    init_runtime,
    resolve_precision,
    runtime_on,
    shutdown,
    with_tf32,
)
from nanopt.train.checkpoint import Checkpoint
from nanopt.train.checkpoint.resume import data_fingerprint
from nanopt.train.health.replay import run_health
from nanopt.train.validation import LossResult, evaluate_by_source
from nanopt.untrusted_text import shell_word

SPLIT = "test"
DEFAULT_EVAL_TOKENS = 1 << 20  # 1,048,576: enough for a loss stable to ~0.01 nats, seconds on one GPU
MAX_EVAL_MICRO_BATCH = 1 << 20
MAX_NEW_TOKENS = 1 << 20
MAX_TEMPERATURE = 1e6  # already uniform sampling long before this


@dataclass(frozen=True)
class EvalOptions:
    checkpoint: str = "latest"  # latest | best | a step directory
    data: Path | None = None  # evaluate on this dataset instead of the run's own (same tokenizer required)
    tokens: int | None = DEFAULT_EVAL_TOKENS  # test tokens over all ranks, capped by the split's size; None: all
    micro_batch_size: int | None = None  # default: the run's micro_batch_size
    samples: SampleSettings | None = field(default_factory=SampleSettings)  # None: no generation
    loss: bool = True  # False: samples and tasks only: no dataset needed when the checkpoint carries its tokenizer
    reuse: bool = False  # return an eval.json made with the same checkpoint and settings instead of recomputing
    tasks: TaskOptions | None = None  # downstream tasks (nanopt.evaluate.tasks); None: none
    harness: HarnessOptions | None = None  # the same tasks scored by lm-evaluation-harness itself; None: not run
    beside_checkpoint: bool = True  # also write eval.json into the checkpoint (the watcher leaves checkpoints/ alone)

    def __post_init__(self) -> None:
        self.validate()  # at construction: a bad option fails before any runtime starts or checkpoint is read

    def validate(self) -> None:
        # Upper bounds far past any real evaluation: a value beyond one is a typo (a micro-batch or a generation
        # of 2**63 would allocate until killed), and NaN would reach the sampler as a crash.
        hint = "see `nanopt eval --help`"
        if not self.loss and self.samples is None and self.tasks is None and self.harness is None:
            raise ConfigError("--no-loss with --no-samples: nothing to evaluate", "drop one of the two")
        check_option("--tokens", self.tokens, 1, INT64_MAX, "a token count such as 1M, or all")
        check_option("--micro-batch-size", self.micro_batch_size, 1, MAX_EVAL_MICRO_BATCH, hint)
        if self.samples is not None:
            s = self.samples
            check_option("--max-new-tokens", s.max_new_tokens, 1, MAX_NEW_TOKENS, hint)
            check_option("--temperature", s.temperature, 0, MAX_TEMPERATURE, "0 is greedy; e.g. 0.8")
            check_option("--top-k", s.top_k, 1, MAX_MODEL_DIMENSION, "0 samples from all tokens; e.g. 50")
            # Prompt i samples with seed + i, which must still fit in 64 bits.
            check_option("--seed", s.seed, 0, INT64_MAX - len(s.prompts), "a whole number such as 0 or 1")
        if self.tasks is not None:
            check_option("--limit", self.tasks.limit, 1, INT64_MAX, "examples per task, e.g. 500")
        if self.harness is not None:
            check_option("--limit", self.harness.limit, 1, INT64_MAX, "examples per task, e.g. 500")


class Progress:
    """Receives evaluation progress; the CLI draws it with rich on rank 0."""

    def start(self, description: str, total_batches: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def stop(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------- evaluating


def evaluate_runs(run_dirs: Sequence[Path], opts: EvalOptions, progress: Progress | None = None,
                  device: str | None = None) -> list[dict]:
    """Evaluate each run's checkpoint on its test split (all ranks under torchrun, or one process on `device`); one
    result per run."""
    rt = init_runtime("auto") if device is None else runtime_on(device)
    try:
        if opts.harness is not None and rt.world_size > 1:
            raise ConfigError("--harness runs lm-evaluation-harness in one process, and this is one of "
                              f"{rt.world_size} ranks", "run the --harness evaluation without torchrun "
                              "(--nproc-per-node 1)")
        results = [evaluate_run(rt, Path(run_dir), opts, progress or Progress()) for run_dir in run_dirs]
        barrier(rt)  # rank 0 may still be sampling; let no rank tear the process group down under it
        return results
    finally:
        shutdown(rt)


def evaluate_run(rt: Runtime, run_dir: Path, opts: EvalOptions, progress: Progress) -> dict[str, Any]:
    trained = open_trained(run_dir, opts.checkpoint, opts.data, for_loss=opts.loss)  # reads only; checks the path
    if opts.loss:  # eval.json goes into the run: a link where it writes is refused before any work, on every rank
        check_run_dir(run_dir)
    if opts.samples:  # a prompt that cannot be continued fails now, before the evaluation
        check_prompts_fit(trained.tokenizer(), opts.samples, trained.run.model.max_position_embeddings)
    if not opts.loss:
        return sample_run(rt, run_dir, trained, opts)
    check_own_checkpoint(run_dir, trained.checkpoint)
    # The run's own precision setting, so test and in-loop validation losses are measured alike.
    rt = with_tf32(replace(rt, precision=resolve_precision(trained.run.train.precision, rt.device)),
                   trained.run.train.tf32)
    micro_batch_size = opts.micro_batch_size or trained.run.train.micro_batch_size
    batches = run_eval_batches(trained.dataset, SPLIT, trained.run.seq_len, micro_batch_size, rt.rank,
                               rt.world_size, opts.tokens)
    settings = eval_settings(trained, rt, opts, tokens=batches.targets)
    context = _context(run_dir, trained, settings)
    if opts.reuse:
        previous = broadcast_object(rt, previous_result(trained.checkpoint, settings, run_dir) if rt.is_main else None)
        reused = None if previous is None else _reused(previous, trained, context, batches.targets)
        if reused is not None:
            return reused

    model = _load(trained, rt)
    started = time.perf_counter()
    progress.start(f"{run_dir} {trained.checkpoint.path.name}", len(batches))
    try:  # a mixture: each source's test split in turn, one progress bar over them all
        loss, by_source = evaluate_by_source(model, rt, batches, track=lambda part: _advancing(part, progress))
    finally:
        progress.stop()
    seconds = time.perf_counter() - started
    tasks = {**_tasks(model, rt, trained, opts, micro_batch_size), **_harness(rt, trained, opts, micro_batch_size)}
    samples = []
    if opts.samples and rt.is_main:
        samples = generate_samples(model, trained.tokenizer(), trained.eos_id, opts.samples)
    result = {**context, **_loss_figures(trained, loss, by_source.get("sources")), "samples": samples, **tasks,
              "micro_batch_size": micro_batch_size, "world_size": rt.world_size, "device": str(rt.device),
              "precision": rt.precision, "tf32": rt.tf32, "eval_seconds": seconds,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    write_result(rt, result, trained, run_dir, opts)
    return result


def _context(run_dir: Path, trained: TrainedModel, settings: dict[str, Any]) -> dict[str, Any]:
    """What a result says that no forward pass measures: which run, checkpoint and data, what training cost to get
    here (from metrics.jsonl), the run's health, the settings it is reused under, and the config the checkpoint was
    trained with (a comparison shows where runs' configs differ)."""
    return {"run": str(run_dir), "checkpoint": str(trained.checkpoint.path), "step": trained.checkpoint.step,
            "notes": _notes(trained), "dataset": str(trained.dataset.path), "split": SPLIT,
            "config": trained.run.snapshot(),
            "split_tokens": trained.dataset.split_tokens(SPLIT), **training_record(trained),
            "tokenizer_check": trained.tokenizer_check, "settings": settings,
            "health": run_health(trained.run) if trained.run.train.health else None}


def _loss_figures(trained: TrainedModel, loss: LossResult, scored: dict[str, Any] | None) -> dict[str, Any]:
    """The test loss with its perplexity and bits per byte, and a mixture's per-source figures."""
    bytes_per_token, sources = _by_source(trained.dataset, scored)
    return {"test_loss": loss.loss, "perplexity": loss.perplexity, "tokens": loss.tokens,
            "bits_per_byte": bits_per_byte(loss.loss, bytes_per_token), "bytes_per_token": bytes_per_token,
            **sources}


def _reused(previous: dict[str, Any], trained: TrainedModel, context: dict[str, Any],
            tokens: int) -> dict[str, Any] | None:
    """An earlier result for this checkpoint and these settings: what it measured, checked (nanopt.evaluate.reuse),
    with everything else worked out again; None, with a note, when a measured value is wrong."""
    try:
        part = measured(previous, tokens, list(getattr(trained.dataset, "names", [])))
    except NotReusable as exc:
        context["notes"].append(f"an earlier result for this checkpoint was not reused ({exc}): evaluated again")
        return None
    scored = {name: {"val_loss": source["test_loss"], "val_tokens": source["tokens"]}
              for name, source in part.pop("sources", {}).items()}
    figures = _loss_figures(trained, LossResult(part["test_loss"], tokens), scored or None)
    return {**context, **part, **figures, "reused": True}


def _by_source(dataset: Any, scored: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
    """The test split's bytes per token (a mixture's: over the tokens scored of each source) and, for a mixture,
    eval.json's `sources`: each source's test loss, tokens scored and bits per byte."""
    if not scored:
        return dataset.bytes_per_token(SPLIT), {}
    sources = {}
    for name, part in scored.items():
        source = dataset.dataset_of(name)
        per_token = source.bytes_per_token(SPLIT)
        sources[name] = {"dataset": str(source.path), "test_loss": part["val_loss"], "tokens": part["val_tokens"],
                         "bytes_per_token": per_token, "bits_per_byte": bits_per_byte(part["val_loss"], per_token)}
    tokens = sum(part["tokens"] for part in sources.values())
    return sum(part["tokens"] * part["bytes_per_token"] for part in sources.values()) / tokens, {"sources": sources}


def _notes(trained: TrainedModel) -> list[str]:
    note = fallback_note(trained)
    return [note] if note else []


def _load(trained: TrainedModel, rt: Runtime) -> Any:
    """The model with the checkpoint's weights, read in full now: from here on the evaluation needs none of the
    checkpoint's files, which a training of the same run may delete (retention) while it runs."""
    try:
        return load_model(trained, rt.device)
    except FileNotFoundError:
        if trained.checkpoint.path.is_dir():
            raise
        raise CheckpointError(f"{trained.checkpoint.path} was removed while eval read it ({_who_removed(trained)})",
                              "evaluate a checkpoint that training keeps (--checkpoint latest), or evaluate once "
                              "training has ended") from None


def _who_removed(trained: TrainedModel) -> str:
    return (f"a `nanopt train` of this run keeps only its newest {trained.run.train.keep_checkpoints} "
            "checkpoint(s) and deletes older ones")


def check_own_checkpoint(run_dir: Path, ckpt: Checkpoint) -> None:
    """CheckpointError when --checkpoint is a path into another run's checkpoints/: its result would be recorded as
    RUN's (RUN/eval.json, RUN's training cost) and its eval.json written into the other run. A checkpoint kept
    outside any run (a copy, a backup) is evaluated as RUN's, as asked."""
    holder = ckpt.path.resolve().parent
    if holder == RunDir(run_dir).checkpoints.resolve() or holder.name != CHECKPOINTS:
        return
    owner = RunDir(holder.parent)
    if owner.model_json.is_file() or owner.train_json.is_file():
        raise CheckpointError(f"{ckpt.path} is a checkpoint of the run {owner.root}, not of {run_dir}: its result "
                              f"would be recorded as {run_dir}'s",
                              f"evaluate it as its own run's: nanopt eval {shell_word(owner.root)} --checkpoint "
                              f"{ckpt.path.name}")


def _tasks(model: Any, rt: Runtime, trained: TrainedModel, opts: EvalOptions, micro_batch_size: int) -> dict:
    """{"tasks": ..., "centered_mean": ...} for --tasks, else {}."""
    if opts.tasks is None:
        return {}
    from nanopt.evaluate.tasks.downstream import evaluate_tasks

    return evaluate_tasks(model, rt, trained.tokenizer(), trained.eos_id, opts.tasks, micro_batch_size)


def _harness(rt: Runtime, trained: TrainedModel, opts: EvalOptions, micro_batch_size: int) -> dict:
    """{"harness": ..., "harness_seconds": ...} for --harness, else {}."""
    if opts.harness is None:
        return {}
    from nanopt.evaluate.tasks.harness import run_harness

    return run_harness(trained, opts.harness, str(rt.device), micro_batch_size)


def sample_run(rt: Runtime, run_dir: Path, trained: TrainedModel, opts: EvalOptions) -> dict[str, Any]:
    """Samples and downstream tasks only (`--no-loss`): no test loss is measured, so no eval.json is written, which
    comparisons would read as a test loss. The dataset is None unless --data named one (an old checkpoint's
    tokenizer comes from it)."""
    settings = opts.samples
    model = _load(trained, rt)
    micro_batch_size = opts.micro_batch_size or trained.run.train.micro_batch_size
    tasks = {**_tasks(model, rt, trained, opts, micro_batch_size), **_harness(rt, trained, opts, micro_batch_size)}
    samples = generate_samples(model, trained.tokenizer(), trained.eos_id, settings) if rt.is_main and settings else []
    return {"run": str(run_dir), "checkpoint": str(trained.checkpoint.path), "step": trained.checkpoint.step,
            "notes": _notes(trained),
            "dataset": str(trained.dataset.path) if trained.dataset else None, "test_loss": None,
            "tokenizer_check": trained.tokenizer_check, "samples": samples, **tasks,
            "settings": {"samples": asdict(settings) if settings else None}, "config": trained.run.snapshot(),
            "device": str(rt.device)}


def write_result(rt: Runtime, result: dict[str, Any], trained: TrainedModel, run_dir: Path,
                 opts: EvalOptions) -> None:
    """Rank 0 writes eval.json beside the checkpoint (unless opts.beside_checkpoint is off) and into the run, each
    atomically, and appends the result to the run's eval_history.jsonl; every rank learns whether it could, so all
    raise or none does. A checkpoint that a training of the run removed while it was evaluated costs only the copy
    beside it: the result is kept in the run, with a note that says so."""
    failure, run_file = None, RunDir(run_dir).eval_json
    if rt.is_main:
        try:
            if opts.beside_checkpoint and not _saved_beside(trained.checkpoint.path, result):
                result["notes"].append(f"{trained.checkpoint.path.name} was removed while it was evaluated "
                                       f"({_who_removed(trained)}): the result is kept in {run_file} only")
            save_json(run_file, result)
            append_result(run_dir, result, trained.checkpoint.meta, opts)
        except OSError as exc:
            failure = (f"could not write {exc.filename or run_file}: {exc.strerror or exc}",
                       "make the run directory writable, or copy the run somewhere writable")
        except WritePathError as exc:  # a link at eval.json or its temporary: never written through
            failure = (exc.message, exc.hint)
    failure = broadcast_object(rt, failure)
    if failure is not None:
        raise CheckpointError(*failure)


def _saved_beside(checkpoint: Path, result: dict[str, Any]) -> bool:
    """Write the checkpoint's eval.json; False when the checkpoint directory is gone."""
    try:
        save_json(checkpoint / EVAL_FILE, result)
    except FileNotFoundError:
        if checkpoint.is_dir():
            raise
        return False
    return True


def bits_per_byte(loss_nats_per_token: float, bytes_per_token: float) -> float:
    return loss_nats_per_token / math.log(2) / bytes_per_token


def _advancing(batches: Sequence, progress: Progress) -> Iterator:
    for batch in batches:
        yield batch
        progress.advance()


def eval_settings(trained: TrainedModel, rt: Runtime, opts: EvalOptions, tokens: int) -> dict[str, Any]:
    """Everything that determines an eval.json's numbers and samples: the key under which one is reused.

    The scored tokens are the split's first `tokens` targets whatever the micro-batch and world size, so those two
    are not part of the key; the rule that picks them is (`slice`), so a result made under an earlier rule (which
    trimmed the slice to the world size) is recomputed, never reused as if comparable.
    """
    settings = {
        "split": SPLIT, "slice": EVAL_SLICE_VERSION,
        "weights_sha256": trained.checkpoint.meta.get("files", {}).get("model.safetensors"),
        "data_fingerprint": data_fingerprint(trained.dataset),
        "tokenizer_sha256": tokenizer_identity(trained.dataset)[1], "seq_len": trained.run.seq_len,
        "max_tokens": opts.tokens, "tokens": tokens, "precision": rt.precision,
        "samples": asdict(opts.samples) if opts.samples else None,
        # Task files are named by path: --fresh recomputes after they change.
        "tasks": _task_settings(opts.tasks),
    }
    if opts.harness is not None:  # only then: eval.json files made before --harness existed are still reused
        settings["harness"] = opts.harness.settings()
    return json.loads(json.dumps(settings))  # tuples become lists, as they come back from eval.json


def _task_settings(tasks: TaskOptions | None) -> dict[str, Any] | None:
    if tasks is None:
        return None
    return {**asdict(tasks), "task_data": None if tasks.task_data is None else str(tasks.task_data)}


