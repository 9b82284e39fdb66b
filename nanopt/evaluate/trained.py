"""Opening a trained checkpoint for evaluation, sampling or export: its config snapshot, its weights, and a
dataset whose tokenizer is the one it was trained with.

A checkpoint is rebuilt from its own config snapshot (not today's model.json), and may be used with any dataset
made with the tokenizer it was trained with: the tokenizer.json sha256 the checkpoint records (older checkpoints:
the training dataset's tokenizer.json, when it is still there). The dataset's tokenizer is parsed when it is
opened, so an unreadable one fails before the evaluation or export runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from nanopt.config import RunConfig, TrainConfig, model_config_from_snapshot
from nanopt.data.dataset import TokenDataset, check_compatible, open_run_dataset
from nanopt.errors import CheckpointError, ConfigError, DataError
from nanopt.model.transformer import Transformer
from nanopt.parsing import from_dict
from nanopt.train.checkpoint import Checkpoint, load_model_state, resolve


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint, the run configuration it was trained with, and the dataset to use it with."""

    run: RunConfig  # from the checkpoint's config snapshot
    checkpoint: Checkpoint
    dataset: TokenDataset
    tokenizer_check: str  # how the dataset's tokenizer was checked against the training data's


def open_trained(run_dir: Path, which: str = "latest", data: Path | None = None) -> TrainedModel:
    """Resolve and verify a checkpoint; open its training dataset, or `data` if it has the same tokenizer."""
    run_dir = Path(run_dir)
    check_run_directory(run_dir)
    ckpt = resolve(run_dir, which)
    run = run_config_from_snapshot(run_dir, ckpt)
    dataset = TokenDataset.open(data) if data is not None else open_run_dataset(run)
    dataset.tokenizer()  # samples and export need it: an unreadable file fails now, not after the work
    tokenizer_check = check_same_tokenizer(run, ckpt, dataset)
    check_compatible(dataset, run.model.vocab_size)
    return TrainedModel(run=run, checkpoint=ckpt, dataset=dataset, tokenizer_check=tokenizer_check)


def check_run_directory(run_dir: Path) -> None:
    """ConfigError unless `run_dir` is an existing directory: one line for a path that is a file, a path that is
    missing and a path the operating system cannot even look up (a name too long, a loop of symbolic links)."""
    hint = "pass a run directory that `nanopt train` wrote"
    try:
        is_file, is_dir = run_dir.is_file(), run_dir.is_dir()
    except OSError as exc:
        text = str(run_dir)
        shown = text if len(text) <= 60 else f"{text[:60]}... ({len(text):,} characters)"
        raise ConfigError(f"{shown}: not a usable path ({exc.strerror})", hint) from None
    if is_file:
        raise ConfigError(f"{run_dir}: is a file, not a directory (a run is a directory)", hint)
    if not is_dir:
        raise ConfigError(f"{run_dir}: run directory not found", hint)


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
    return dataset.vocab_size, dataset.tokenizer_sha256


def check_same_tokenizer(run: RunConfig, ckpt: Checkpoint, dataset: TokenDataset) -> str:
    """DataError unless `dataset` was made with the tokenizer the checkpoint was trained with; returns what was
    checked.

    Token ids mean nothing across tokenizers: a model evaluated on another tokenizer's ids gives a meaningless
    loss rather than an error, so the mismatch must be caught here.
    """
    trained_path = run.data_dir
    own = trained_path.resolve() == dataset.path.resolve()
    recorded = ckpt.meta.get("tokenizer_sha256")
    if isinstance(recorded, str):
        if dataset.tokenizer_sha256 != recorded:
            raise _another_tokenizer(run, dataset, f"tokenizer.json sha256 {dataset.tokenizer_sha256[:12]} vs "
                                                   f"{recorded[:12]} recorded in {ckpt.path.name}", own)
        return ("the run's own dataset" if own else "same tokenizer") + (
            f" (tokenizer.json sha256 as recorded in {ckpt.path.name})")
    # A checkpoint written before nanopt recorded the tokenizer's hash: compare with the training dataset.
    if own:
        return "the run's own dataset"
    try:
        trained_on = TokenDataset.open(trained_path, verify_up_to_bytes=0)  # only its tokenizer is compared
    except DataError:
        return f"vocabulary size only (the training dataset {trained_path} is not available)"
    expected, found = tokenizer_identity(trained_on), tokenizer_identity(dataset)
    if expected != found:
        raise _another_tokenizer(run, dataset, f"vocabulary {found[0]:,} vs {expected[0]:,}, tokenizer.json sha256 "
                                               f"{found[1][:12]} vs {expected[1][:12]}", own)
    return f"same tokenizer as {trained_path} (vocabulary size and tokenizer.json sha256)"


def _another_tokenizer(run: RunConfig, dataset: TokenDataset, difference: str, own: bool) -> DataError:
    trained_path = run.data_dir
    if own:  # the training dataset's path now holds another dataset: its tokenizer.json is not the one to use
        return DataError(f"{dataset.path} was made with another tokenizer than {run.run_dir} was trained on: it was "
                         f"re-made since training ({difference})",
                         "re-create it with the run's original tokenizer.json: `nanopt tokenize SOURCE --tokenizer "
                         "ORIGINAL/tokenizer.json --out DIR`, then pass --data DIR")
    return DataError(f"{dataset.path} was made with another tokenizer than {run.run_dir} was trained on "
                     f"({trained_path}): {difference}",
                     f"tokenize the corpus with the run's tokenizer: `nanopt tokenize SOURCE --tokenizer "
                     f"{trained_path / 'tokenizer.json'} --out DIR`, then pass --data DIR")


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
