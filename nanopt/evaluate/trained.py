"""Opening a trained checkpoint for evaluation, sampling or export: its config snapshot, its weights, its
tokenizer, and a dataset made with that tokenizer when one is needed or asked for.

A checkpoint is rebuilt from its own config snapshot (not today's model.json). It carries the tokenizer.json it was
trained with (verified by sha256 with its other files) and the EOS id, so sampling and export need no dataset; the
test loss needs one, which may be any dataset made with that tokenizer (compared by sha256). Checkpoints written
before they carried the tokenizer take it from a dataset, as they always did: the training dataset or --data,
compared by the sha256 they record (older still: with the training dataset's tokenizer.json, when it is there).
A tokenizer is parsed when it is opened, so an unreadable one fails before the evaluation or export runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanopt.config import RunConfig, train_config_from_snapshot
from nanopt.config.no_data import is_placeholder
from nanopt.data.dataset import TokenDataset, check_compatible
from nanopt.data.mixtures.mixture import open_run_data
from nanopt.data.output import is_dataset
from nanopt.data.tokenizers.tokenizer import read_tokenizer_file
from nanopt.errors import CheckpointError, ConfigError, DataError
from nanopt.model.transformer import Transformer
from nanopt.parsing import path_kind, plain_path
from nanopt.train.checkpoint import Checkpoint, check_fits, latest, load_weights, resolve
from nanopt.untrusted_text import shell_word

DATASET_HINT = "pass a dataset directory made by `nanopt tokenize` (it holds meta.json, tokenizer.json and the shards)"


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint, the run configuration it was trained with, its tokenizer, and a dataset when one is open."""

    run: RunConfig  # from the checkpoint's config snapshot
    checkpoint: Checkpoint
    dataset: TokenDataset | None  # open when the loss needs one or --data named one
    tokenizer_path: Path  # the checkpoint's own tokenizer.json (older checkpoints: the dataset's)
    eos_id: int  # the id that separates documents, from the checkpoint (older checkpoints: the dataset)
    tokenizer_check: str  # how the tokenizer was checked against the one the run trained with
    _tokenizer: Any = field(repr=False, compare=False)
    # Why `latest` was not the newest checkpoint (damaged ones passed over), or () when it was.
    fallback_notes: tuple[str, ...] = ()

    def tokenizer(self) -> Any:
        """The parsed tokenizers.Tokenizer (read when the checkpoint was opened)."""
        return self._tokenizer


def open_trained(run_dir: Path, which: str = "latest", data: Path | None = None, *,
                 for_loss: bool = True) -> TrainedModel:
    """Resolve and verify a checkpoint and read its tokenizer. A dataset is opened when `data` names one (it must
    use the checkpoint's tokenizer), or, without `data`, the training dataset when the loss needs it (`for_loss`)
    or the checkpoint is too old to carry its tokenizer."""
    run_dir = Path(run_dir)
    check_run_directory(run_dir)
    ckpt, fallback_notes = _resolve_saying_fallback(run_dir, which)
    run = run_config_from_snapshot(run_dir, ckpt)
    carried = ckpt.tokenizer_path
    dataset = _open_dataset(run, ckpt, data, for_loss)
    if dataset is None:
        own = read_tokenizer_file(carried, "use another checkpoint", CheckpointError)
        return TrainedModel(run=run, checkpoint=ckpt, dataset=None, tokenizer_path=carried,
                            eos_id=ckpt.meta["eos_id"], tokenizer_check=f"the tokenizer.json {ckpt.path.name} "
                            "carries", _tokenizer=own, fallback_notes=fallback_notes)
    tokenizer = dataset.tokenizer()  # an unreadable file fails now, not after the work
    tokenizer_check = check_same_tokenizer(run, ckpt, dataset)
    check_compatible(dataset, run.model.vocab_size)
    # A carried tokenizer has the dataset's bytes (same sha256), so either parse serves.
    return TrainedModel(run=run, checkpoint=ckpt, dataset=dataset, tokenizer_path=carried or dataset.tokenizer_path,
                        eos_id=ckpt.meta["eos_id"] if carried else dataset.eos_id, tokenizer_check=tokenizer_check,
                        _tokenizer=tokenizer, fallback_notes=fallback_notes)


def _resolve_saying_fallback(run_dir: Path, which: str) -> tuple[Checkpoint, tuple[str, ...]]:
    """The checkpoint `which` names and, for `latest`, why it is not the newest one when a damaged newer one was
    passed over: a result or an export must never silently come from older weights than the user expects."""
    if which in ("latest", "auto"):
        found, notes = latest(run_dir)
        if found is not None:
            return found, tuple(notes)
    return resolve(run_dir, which), ()  # raises the error that says why there is none


def fallback_note(trained: TrainedModel) -> str | None:
    """One line naming the checkpoint used and the newer one(s) passed over, or None when `latest` was used."""
    if not trained.fallback_notes:
        return None
    return (f"using {trained.checkpoint.path.name}, not the newest checkpoint: "
            f"{'; '.join(note.rstrip('.') for note in trained.fallback_notes)}")


def refuse_fallback(trained: TrainedModel) -> None:
    """For export: CheckpointError when `latest` could not be used and an older checkpoint would be shipped in its
    place without the user having asked for it by name."""
    if trained.fallback_notes:
        name = trained.checkpoint.path.name
        passed_over = "; ".join(note.rstrip(".") for note in trained.fallback_notes)
        raise CheckpointError(f"{trained.run.run_dir}: {passed_over}; not exporting the older {name} in its place",
                              f"to export {name}, name it: --checkpoint {name}; for the newest weights, repair "
                              "or retrain the damaged checkpoint")


def _open_dataset(run: RunConfig, ckpt: Checkpoint, data: Path | None, for_loss: bool) -> TokenDataset | None:
    if data is not None:
        return TokenDataset.open(_dataset_directory(plain_path(data), ckpt))
    if not for_loss and ckpt.tokenizer_path is not None:
        return None  # sampling and export use the checkpoint's own tokenizer
    if path_kind(run.data_dir, DataError, DATASET_HINT) == "missing":
        raise _no_dataset(run, ckpt)
    return open_run_data(run)  # a mixture: every source, each scored on its own test split


def _dataset_directory(data: Path, ckpt: Checkpoint) -> Path:
    """--data names a dataset directory; a file, such as the tokenizer.json inside one, is refused with the
    directory to pass instead."""
    if path_kind(data, DataError, DATASET_HINT) == "file":
        holder = data.parent
        if is_dataset(holder):
            hint = f"pass the dataset directory that holds it: --data {shell_word(holder)}"
        elif ckpt.tokenizer_path is not None:
            hint = f"{DATASET_HINT}, or leave --data out: {ckpt.path.name} carries its tokenizer"
        else:
            hint = DATASET_HINT
        raise DataError(f"{data}: is a file; --data takes a dataset directory", hint)
    return data


def _no_dataset(run: RunConfig, ckpt: Checkpoint) -> DataError:
    """The training dataset is gone (deleted or moved) and a dataset is needed: for the loss, or for the tokenizer
    of a checkpoint that does not carry one."""
    where = f"the dataset it trained on is not at {run.data_dir} (train.json 'data' then: {run.train.data!r})"
    if ckpt.tokenizer_path is None:
        return DataError(f"{ckpt.path} carries no tokenizer (written before checkpoints carried one), and {where}",
                         "pass --data DIR, a dataset made with the run's tokenizer")
    return DataError(f"{run.run_dir}: the test loss needs a dataset, and {where}",
                     f"pass --data DIR, a dataset made with the run's tokenizer (`nanopt tokenize SOURCE --tokenizer "
                     f"{shell_word(ckpt.tokenizer_path)} --out DIR`), or --no-loss for samples only")


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
    """The configuration the checkpoint was trained with (model.json may have been edited since), validated as
    model.json and train.json are (the model's when the checkpoint was verified)."""
    model = ckpt.model
    try:
        train = train_config_from_snapshot(ckpt.meta["config"]["train"], model, "config.train")
    except ConfigError as exc:
        raise CheckpointError(f"{ckpt.path / 'meta.json'}: {exc.message} (a damaged or foreign checkpoint)",
                              "use another checkpoint") from None
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
    trained_path = _trained_on(run)
    own = trained_path is not None and trained_path.resolve() == dataset.path.resolve()
    recorded = ckpt.meta.get("tokenizer_sha256")
    if isinstance(recorded, str):
        if dataset.tokenizer_sha256 != recorded:
            difference = (f"tokenizer.json sha256 {dataset.tokenizer_sha256[:12]} vs {recorded[:12]} recorded in "
                          f"{ckpt.path.name}")
            raise _another_tokenizer(run, ckpt, dataset, difference, own)
        return ("the run's own dataset" if own else "same tokenizer") + (
            f" (tokenizer.json sha256 as recorded in {ckpt.path.name})")
    # A checkpoint written before nanopt recorded the tokenizer's hash: compare with the training dataset.
    if own:
        return "the run's own dataset"
    if trained_path is None:
        return "vocabulary size only (the run has no dataset of its own to compare with)"
    try:
        trained_on = TokenDataset.open(trained_path, verify_up_to_bytes=0)  # only its tokenizer is compared
    except DataError:
        return f"vocabulary size only (the training dataset {trained_path} is not available)"
    expected, found = tokenizer_identity(trained_on), tokenizer_identity(dataset)
    if expected != found:
        difference = (f"vocabulary {found[0]:,} vs {expected[0]:,}, tokenizer.json sha256 {found[1][:12]} vs "
                      f"{expected[1][:12]}")
        raise _another_tokenizer(run, ckpt, dataset, difference, own)
    return f"same tokenizer as {trained_path} (vocabulary size and tokenizer.json sha256)"


def _another_tokenizer(run: RunConfig, ckpt: Checkpoint, dataset: TokenDataset, difference: str,
                       own: bool) -> DataError:
    trained_path = _trained_on(run)
    original = ckpt.tokenizer_path or (trained_path or Path("ORIGINAL")) / "tokenizer.json"
    if own:  # the training dataset's path now holds another dataset: its tokenizer.json is not the one to use
        return DataError(f"{dataset.path} was made with another tokenizer than {run.run_dir} was trained on: it was "
                         f"re-made since training ({difference})",
                         f"re-create it with the run's original tokenizer.json: `nanopt tokenize SOURCE --tokenizer "
                         f"{shell_word(ckpt.tokenizer_path or 'ORIGINAL/tokenizer.json')} --out DIR`, then pass "
                         "--data DIR")
    trained_on = "" if trained_path is None else f" ({trained_path})"
    return DataError(f"{dataset.path} was made with another tokenizer than {run.run_dir} was trained on"
                     f"{trained_on}: {difference}",
                     f"tokenize the corpus with the run's tokenizer: `nanopt tokenize SOURCE --tokenizer "
                     f"{shell_word(original)} --out DIR`, then pass --data DIR")


def _trained_on(run: RunConfig) -> Path | None:
    """The dataset directory the run trained on, or None for an imported run that has none yet (--data then names
    the only dataset there is)."""
    return None if is_placeholder(run.train.data) else run.data_dir


def token_rows(trained: TrainedModel) -> int:
    """How many rows of the model's vocabulary are tokens: the tokenizer's size (with its added tokens, as the
    export counts them), or the dataset's id range when that is larger; rows past it are padding that the loss,
    the evaluation and sampling leave out, so they give what transformers gives on the export."""
    tokens = trained.tokenizer().get_vocab_size()
    if trained.dataset is not None:
        tokens = max(tokens, trained.dataset.id_limit)
    return min(tokens, trained.run.model.vocab_size)


def load_model(trained: TrainedModel, device: torch.device) -> Transformer:
    """Transformer(config snapshot) with the checkpoint's weights, strictly, in eval mode on `device`; rows of a
    padded vocabulary past the tokenizer's are out of its logits and loss (token_rows).

    The names and shapes were compared on the meta device when the checkpoint was verified; the weights must fit
    the device (CheckpointError, one line, before anything is allocated). Built directly on the device: its random
    init is fast on a GPU and tiny for a CPU-sized model.
    """
    check_fits(trained.checkpoint, device)
    with torch.device(device):
        model = Transformer(trained.run.model, tokenizer_vocab_size=token_rows(trained))
    load_weights(model, trained.checkpoint)  # tensor by tensor, either layout: one copy of the weights in memory
    return model.eval()
