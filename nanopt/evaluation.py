"""Evaluate a trained checkpoint: loss, perplexity and bits per byte on the held-out test split, plus samples.

The test split is never read by training (train split) or its in-loop evaluation (val split), so its loss is the
number to compare runs by. It is measured on a fixed slice: the first `tokens` tokens of the split (all of it if
smaller), cut into the loader's seq_len windows, so every evaluation of a checkpoint reads the same tokens on any
number of ranks (when the count divides evenly; see nanopt.data.loader.eval_batches).

Bits per byte = loss (nats per token) / ln 2 / (UTF-8 bytes per token of the split). It does not depend on the
tokenizer, so it compares runs whose tokenizers differ; loss and perplexity only compare runs sharing one.

A checkpoint is rebuilt from its own config snapshot (not today's model.json), and may be evaluated on any
dataset made with the tokenizer it was trained with: same vocabulary size and same tokenizer.json bytes.

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

import torch

from nanopt.checkpoint import Checkpoint, load_model_state, resolve
from nanopt.config import RunConfig, TrainConfig, from_dict, model_config_from_snapshot, save_json
from nanopt.data.dataset import TokenDataset, check_compatible
from nanopt.data.loader import eval_batches
from nanopt.data.shards import sha256_file
from nanopt.errors import CheckpointError, ConfigError, DataError
from nanopt.evaluate import evaluate_loss
from nanopt.flops import count_params
from nanopt.generate import generate
from nanopt.metrics import read_metrics
from nanopt.model import Transformer
from nanopt.resume import data_fingerprint
from nanopt.runtime import Runtime, barrier, broadcast_object, init_runtime, resolve_precision, shutdown

SPLIT = "test"
EVAL_FILE = "eval.json"
DEFAULT_EVAL_TOKENS = 1 << 20  # 1,048,576: enough for a loss stable to ~0.01 nats, seconds on one GPU
# An empty prompt starts a fresh document (an unconditional sample); the others suit both code and prose corpora.
# No trailing spaces: byte-level BPE tokenizers attach a space to the word after it, so a prompt ending in one
# leaves the model an unusual lone-space token to continue.
DEFAULT_PROMPTS = ("", "def", "The")


@dataclass(frozen=True)
class SampleSettings:
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = 50
    seed: int = 0


@dataclass(frozen=True)
class EvalOptions:
    checkpoint: str = "latest"  # latest | best | a step directory
    data: Path | None = None  # evaluate on this dataset instead of the run's own (same tokenizer required)
    tokens: int | None = DEFAULT_EVAL_TOKENS  # test tokens over all ranks, capped by the split's size; None: all
    micro_batch_size: int | None = None  # default: the run's micro_batch_size
    samples: SampleSettings | None = field(default_factory=SampleSettings)  # None: no generation
    reuse: bool = False  # return an eval.json made with the same checkpoint and settings instead of recomputing


class Progress:
    """Receives evaluation progress; the CLI draws it with rich on rank 0."""

    def start(self, description: str, total_batches: int) -> None:
        pass

    def advance(self) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint, the run configuration it was trained with, and the dataset to use it with."""

    run: RunConfig  # from the checkpoint's config snapshot
    checkpoint: Checkpoint
    dataset: TokenDataset
    tokenizer_check: str  # how the dataset's tokenizer was checked against the training data's


# ------------------------------------------------------------------------------------------ opening a checkpoint


def open_trained(run_dir: Path, which: str = "latest", data: Path | None = None) -> TrainedModel:
    """Resolve and verify a checkpoint; open its training dataset, or `data` if it has the same tokenizer."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: run directory not found", "pass a run directory that `nanopt train` wrote")
    ckpt = resolve(run_dir, which)
    run = run_config_from_snapshot(run_dir, ckpt)
    dataset = TokenDataset.open(data if data is not None else run.train.data)
    tokenizer_check = check_same_tokenizer(run, dataset)
    check_compatible(dataset, run.model.vocab_size)
    return TrainedModel(run=run, checkpoint=ckpt, dataset=dataset, tokenizer_check=tokenizer_check)


def run_config_from_snapshot(run_dir: Path, ckpt: Checkpoint) -> RunConfig:
    """The configuration the checkpoint was trained with: model.json may have been edited since."""
    snapshot = ckpt.meta.get("config")
    if not isinstance(snapshot, dict) or not {"model", "train"} <= set(snapshot):
        raise CheckpointError(f"{ckpt.path / 'meta.json'}: no config snapshot", "use a checkpoint written by "
                              "`nanopt train`")
    model = model_config_from_snapshot(snapshot["model"])
    train = from_dict(TrainConfig, snapshot["train"], "checkpoint meta.json train config")
    return RunConfig(run_dir=run_dir, model=model, train=train)


def tokenizer_identity(dataset: TokenDataset) -> tuple[int, str]:
    """Vocabulary size and the sha256 of the exact tokenizer.json bytes."""
    return dataset.vocab_size, sha256_file(dataset.tokenizer_path)


def check_same_tokenizer(run: RunConfig, dataset: TokenDataset) -> str:
    """DataError unless `dataset` was made with the tokenizer of the run's training data; returns what was checked.

    Token ids mean nothing across tokenizers: a model evaluated on another tokenizer's ids gives a meaningless
    loss rather than an error, so the mismatch must be caught here.
    """
    trained_path = Path(run.train.data)
    if trained_path.resolve() == dataset.path.resolve():
        return "the run's own dataset"
    try:
        trained_on = TokenDataset.open(trained_path)
    except DataError:
        return f"vocabulary size only (the training dataset {trained_path} is not available)"
    expected, found = tokenizer_identity(trained_on), tokenizer_identity(dataset)
    if expected != found:
        raise DataError(
            f"{dataset.path} was made with another tokenizer than {run.run_dir} was trained on ({trained_path}): "
            f"vocabulary {found[0]:,} vs {expected[0]:,}, tokenizer.json sha256 {found[1][:12]} vs {expected[1][:12]}",
            f"tokenize the corpus with the run's tokenizer: `nanopt tokenize SOURCE --tokenizer "
            f"{trained_on.tokenizer_path} --out DIR`, then pass --data DIR")
    return f"same tokenizer as {trained_path} (vocabulary size and tokenizer.json sha256)"


def load_model(trained: TrainedModel, device: torch.device) -> Transformer:
    """Transformer(config snapshot) with the checkpoint's weights, strictly, in eval mode on `device`.

    Built directly on the device: its random init is fast on a GPU and tiny for a CPU-sized model, and costs less
    than building on the meta device, whose first use in a process takes over a second.
    """
    with torch.device(device):
        model = Transformer(trained.run.model)
    try:
        model.load_state_dict(load_model_state(trained.checkpoint), strict=True)
    except RuntimeError as exc:
        first_line = str(exc).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{trained.checkpoint.path}: weights do not match its own model config "
                              f"({first_line})", "use another checkpoint") from None
    return model.eval()


# ------------------------------------------------------------------------------------------------- evaluating


def evaluate_runs(run_dirs: Sequence[Path], opts: EvalOptions, progress: Progress | None = None) -> list[dict]:
    """Evaluate each run's checkpoint on its test split (all ranks under torchrun); one result per run."""
    rt = init_runtime("auto")
    try:
        results = [evaluate_run(rt, Path(run_dir), opts, progress or Progress()) for run_dir in run_dirs]
        barrier(rt)  # rank 0 may still be sampling; let no rank tear the process group down under it
        return results
    finally:
        shutdown(rt)


def evaluate_run(rt: Runtime, run_dir: Path, opts: EvalOptions, progress: Progress) -> dict[str, Any]:
    trained = open_trained(run_dir, opts.checkpoint, opts.data)
    # The run's own precision setting, so test and in-loop validation losses are measured alike.
    rt = replace(rt, precision=resolve_precision(trained.run.train.precision, rt.device))
    micro_batch_size = opts.micro_batch_size or trained.run.train.micro_batch_size
    batches = eval_batches(trained.dataset, SPLIT, trained.run.seq_len, micro_batch_size, rt.rank, rt.world_size,
                           opts.tokens or trained.dataset.split_tokens(SPLIT))
    settings = eval_settings(trained, rt, opts, tokens=len(batches) * micro_batch_size * trained.run.seq_len
                             * rt.world_size)
    if opts.reuse:
        previous = broadcast_object(rt, previous_result(trained.checkpoint, settings) if rt.is_main else None)
        if previous is not None:
            return {**previous, "reused": True}

    model = load_model(trained, rt.device)
    started = time.perf_counter()
    loss = evaluate_loss(model, rt, _tracked(batches, progress, f"{run_dir} {trained.checkpoint.path.name}"))
    seconds = time.perf_counter() - started
    samples = generate_samples(model, trained.dataset, opts.samples) if opts.samples and rt.is_main else []
    bytes_per_token = trained.dataset.bytes_per_token(SPLIT)
    result = {
        "run": str(run_dir), "checkpoint": str(trained.checkpoint.path), "step": trained.checkpoint.step,
        "dataset": str(trained.dataset.path), "split": SPLIT,
        "test_loss": loss.loss, "perplexity": loss.perplexity,
        "bits_per_byte": bits_per_byte(loss.loss, bytes_per_token), "tokens": loss.tokens,
        "bytes_per_token": bytes_per_token, **training_record(trained),
        "tokenizer_check": trained.tokenizer_check, "samples": samples, "settings": settings,
        "micro_batch_size": micro_batch_size, "world_size": rt.world_size, "device": str(rt.device),
        "precision": rt.precision, "eval_seconds": seconds,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_result(rt, result, [trained.checkpoint.path / EVAL_FILE, Path(run_dir) / EVAL_FILE])
    return result


def write_result(rt: Runtime, result: dict[str, Any], paths: list[Path]) -> None:
    """Rank 0 writes each file atomically; every rank learns whether it could, so all raise or none does."""
    failure = None
    if rt.is_main:
        try:
            for path in paths:
                save_json(path, result)
        except OSError as exc:
            failure = f"could not write {exc.filename or paths[0]}: {exc.strerror or exc}"
    failure = broadcast_object(rt, failure)
    if failure is not None:
        raise CheckpointError(failure, "make the run directory writable, or copy the run somewhere writable")


def bits_per_byte(loss_nats_per_token: float, bytes_per_token: float) -> float:
    return loss_nats_per_token / math.log(2) / bytes_per_token


def _tracked(batches: Sequence, progress: Progress, description: str) -> Iterator:
    progress.start(description, len(batches))
    try:
        for batch in batches:
            yield batch
            progress.advance()
    finally:
        progress.stop()


def eval_settings(trained: TrainedModel, rt: Runtime, opts: EvalOptions, tokens: int) -> dict[str, Any]:
    """Everything that determines an eval.json's numbers and samples: the key under which one is reused.

    The evaluated windows are the first `tokens` / seq_len of the split whatever the micro-batch and world size,
    so those two are not part of the key.
    """
    settings = {
        "split": SPLIT, "weights_sha256": trained.checkpoint.meta.get("files", {}).get("model.safetensors"),
        "data_fingerprint": data_fingerprint(trained.dataset),
        "tokenizer_sha256": tokenizer_identity(trained.dataset)[1], "seq_len": trained.run.seq_len,
        "max_tokens": opts.tokens, "tokens": tokens, "precision": rt.precision,
        "samples": asdict(opts.samples) if opts.samples else None,
    }
    return json.loads(json.dumps(settings))  # tuples become lists, as they come back from eval.json


def previous_result(ckpt: Checkpoint, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's eval.json if it was made with exactly these settings."""
    try:
        previous = json.loads((ckpt.path / EVAL_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return previous if isinstance(previous, dict) and previous.get("settings") == settings else None


def training_record(trained: TrainedModel) -> dict[str, Any]:
    """What the run cost to get to this checkpoint, as far as the checkpoint and metrics.jsonl tell."""
    meta, run = trained.checkpoint.meta, trained.run
    return {"parameters": count_params(run.model).total, "tokens_trained": int(meta.get("tokens", 0)),
            "global_batch_tokens": run.train.global_batch_tokens, "train_world_size": int(meta.get("world_size", 1)),
            "train_seconds": training_seconds(read_metrics(run.run_dir), trained.checkpoint.step)}


def training_seconds(records: list[dict[str, Any]], up_to_step: int) -> float | None:
    """Sum of logged step times up to a step: step_time_s x the steps since the previous log line.

    Start-up, eval and checkpoint pauses are not step time and are left out. A resume restarts the count at the
    checkpoint's step (steps run after the last log line of a killed session were not logged and are missing).
    None when metrics.jsonl has no step times.
    """
    total, previous_step, found = 0.0, 0, False
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or step > up_to_step:
            continue
        if record.get("kind") == "event" and record.get("event") == "resume":
            previous_step = step
        elif record.get("kind") == "train" and isinstance(record.get("step_time_s"), (int, float)):
            total += record["step_time_s"] * max(0, step - previous_step)
            previous_step, found = step, True
    return total if found else None


# ------------------------------------------------------------------------------------------------- sampling


def generate_samples(model: Transformer, dataset: TokenDataset, settings: SampleSettings) -> list[dict[str, Any]]:
    """One continuation per prompt, each starting a fresh document (after an EOS), decoded to text.

    Prompt i is sampled with seed + i: one shared seed would draw the same random numbers for every prompt, and a
    weak model's samples would then look alike whatever the prompt."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(dataset.tokenizer_path))
    samples = []
    for index, prompt in enumerate(settings.prompts):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        new_ids = generate(model, [dataset.eos_id, *prompt_ids], settings.max_new_tokens, settings.temperature,
                           settings.top_k, settings.seed + index, eos_id=dataset.eos_id)
        samples.append({"prompt": prompt, "completion": _completion(tokenizer, prompt_ids, new_ids),
                        "new_tokens": len(new_ids), "ended": bool(new_ids) and new_ids[-1] == dataset.eos_id})
    return samples


def _completion(tokenizer: Any, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The new text. Decoded together with the prompt, because a byte-level token may complete a character the
    prompt began; special tokens (EOS) are dropped."""
    prompt_text = tokenizer.decode(prompt_ids)
    text = tokenizer.decode(prompt_ids + new_ids)
    return text[len(prompt_text):] if text.startswith(prompt_text) else tokenizer.decode(new_ids)
