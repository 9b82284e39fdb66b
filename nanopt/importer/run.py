"""A run directory from a transformers checkpoint: model.json, train.json (continued-pretraining defaults) and a
step-0 checkpoint that holds the weights and the tokenizer and is marked `weights_only`: `nanopt train` starts
from its weights with a fresh optimizer at step 0, eval and export read it like any checkpoint.

Everything is checked before anything is written (config.json, the tokenizer, every safetensors header against
the model), then the run is assembled in a hidden directory beside its final name and renamed into place at the
end, so an import that fails or is killed at any point leaves no run directory.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanopt.config import ModelConfig, load_run
from nanopt.config.no_data import DATA_PLACEHOLDER
from nanopt.errors import ConfigError
from nanopt.files import make_dir, new_dir, remove_tree, write_file
from nanopt.importer import weights
from nanopt.importer.config import model_config_from_hf
from nanopt.importer.source import Source, open_source
from nanopt.model.layout import meta_model, tied_aliases
from nanopt.parsing import path_kind
from nanopt.rundir import RunDir
from nanopt.train import checkpoint as ckpt


@dataclass
class ImportReport:
    """What an import did, for the CLI's table and --json."""

    run_dir: str
    source: str
    revision: str | None
    architecture: str
    parameters: int
    source_dtypes: list[str]
    checkpoint: str
    checkpoint_bytes: int
    vocab_size: int
    tokenizer_vocab_size: int
    eos_token: str
    eos_id: int
    notes: list[str] = field(default_factory=list)


def import_model(source: str, run_dir: Path, revision: str | None = None) -> ImportReport:
    """Import `source` (a local transformers directory or a hub name) into the new run directory `run_dir`."""
    run_dir = Path(run_dir)
    _check_new(run_dir)
    src = open_source(source, revision)
    cfg = model_config_from_hf(src.config, src.directory / "config.json")
    named = _tokenizer(src, cfg)
    planned = weights.plan(cfg, weights.read_headers(src.weight_files))

    make_dir(run_dir.parent, parents=True)
    staging = _staging(run_dir)
    try:
        write_file(staging / "model.json", _json(_model_json(cfg, src)))
        write_file(staging / "train.json", _json(train_json(cfg, run_dir)))
        run = load_run(staging)  # validated exactly as `nanopt train` will read them
        tmp = ckpt.begin(staging, 0)
        written = weights.write(tmp / "model.safetensors", planned)
        meta = {"weights_only": True, "layout": ckpt.FULL, "tokens": 0, "tied": tied_aliases(meta_model(cfg)),
                "config": run.snapshot(), "data_fingerprint": None,
                "tokenizer_sha256": ckpt.sha256(src.tokenizer_json), "eos_id": named.eos_id,
                "imported_from": {"source": str(source), "revision": revision}}
        final = ckpt.publish(staging, 0, meta, src.tokenizer_json)
        staging.rename(run_dir)
    except BaseException:
        remove_tree(staging, inside=run_dir.parent, quiet=True)
        raise
    return ImportReport(
        run_dir=str(run_dir), source=str(source), revision=revision, architecture=cfg.architecture,
        parameters=weights.parameters(planned), source_dtypes=sorted({p.stored.dtype for p in planned}),
        checkpoint=str(RunDir(run_dir).checkpoints / final.name), checkpoint_bytes=written,
        vocab_size=cfg.vocab_size, tokenizer_vocab_size=named.tokenizer.get_vocab_size(),
        eos_token=named.eos_token, eos_id=named.eos_id, notes=_notes(cfg, named.tokenizer.get_vocab_size()))


def _check_new(run_dir: Path) -> None:
    hint = "import into a new run directory (choose another --run)"
    kind = path_kind(run_dir, ConfigError, hint)  # one line, not a traceback, for a name the OS cannot look up
    if kind == "file" and not run_dir.is_symlink():
        raise ConfigError(f"{run_dir}: is a file, not a run directory", hint)
    if kind != "missing" or run_dir.is_symlink():
        raise ConfigError(f"{run_dir}: already exists", hint)


def _staging(run_dir: Path) -> Path:
    """A new hidden directory beside run_dir; renamed to it once complete."""
    while True:
        try:
            return new_dir(run_dir.parent / f".{run_dir.name}.import-{secrets.token_hex(4)}")
        except FileExistsError:
            continue


def _tokenizer(src: Source, cfg: ModelConfig) -> Any:
    """The source's tokenizer.json and its end-of-text token, by the rule `nanopt tokenize` follows."""
    from nanopt.data.tokenizers.tokenizer import load_tokenizer

    if not src.tokenizer_json.is_file():
        raise ConfigError(f"{src.directory}: has no tokenizer.json", "nanopt trains on token ids of a Hugging Face "
                          "tokenizers file; save the model's tokenizer with save_pretrained (a fast tokenizer)")
    named = load_tokenizer(str(src.tokenizer_json))
    if named.tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ConfigError(f"{src.directory / 'config.json'}: key 'vocab_size': {cfg.vocab_size} is smaller than the "
                          f"tokenizer's {named.tokenizer.get_vocab_size()} tokens", "import a matching tokenizer")
    return named


def _model_json(cfg: ModelConfig, src: Source) -> dict[str, Any]:
    note = (f"Imported from {src.name}" + (f" at revision {src.revision}" if src.revision else "") +
            " by `nanopt import`: the same shapes as its config.json. vocab_size is the source's, not padded: a "
            "padded row would be a new token whose logit counts in every softmax, and the loss would no longer be "
            "the source model's.")
    return {"_note": note, **cfg.to_dict()}


def train_json(cfg: ModelConfig, run_dir: Path) -> dict[str, Any]:
    """Continued-pretraining defaults: a peak learning rate about a tenth of a from-scratch run's (the weights are
    already good; a large one undoes them), a short warmup (for the fresh AdamW moments, not the weights), cosine
    to 10%, and a ~0.5M-token global batch."""
    seq_len = min(cfg.max_position_embeddings, 2048)
    micro = 4
    steps_of = seq_len * micro
    tokenizer = RunDir(run_dir).checkpoints / ckpt.step_dir_name(0) / ckpt.TOKENIZER_FILE
    note = ("Continued pretraining of an imported model. Set `data` to a dataset tokenized with this run's "
            f"tokenizer: `nanopt tokenize CORPUS -o data/NAME --tokenizer {tokenizer}`, then \"data\": the path of "
            "data/NAME relative to this run directory (or absolute). Training starts from the imported weights "
            "(checkpoints/step-000000, a fresh optimizer at step 0). Peak LR ~1/10 of pretraining's, 50 warmup "
            "steps, cosine to 10%; run `nanopt find-batch` to size micro_batch_size and `nanopt estimate` for the "
            "budget.")
    return {
        "_note": note, "data": DATA_PLACEHOLDER, "micro_batch_size": micro, "seq_len": seq_len,
        "global_batch_tokens": max(1, 524288 // steps_of) * steps_of, "train_tokens": 1_000_000_000,
        "learning_rate": 5e-5, "min_lr_ratio": 0.1, "lr_schedule": "cosine", "warmup_steps": 50,
        "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "eval_interval": 250,
        "checkpoint_interval": 500, "keep_checkpoints": 3, "precision": "auto", "parallelism": "ddp",
    }


def _notes(cfg: ModelConfig, tokenizer_vocab: int) -> list[str]:
    notes = ["weights stored as float32 (the master weights nanopt trains; the source's dtype is listed above)",
             "vocabulary not padded: padded rows would be new tokens whose logits count in every softmax"]
    if tokenizer_vocab < cfg.vocab_size:
        notes.append(f"embedding rows {tokenizer_vocab:,} to {cfg.vocab_size - 1:,} are the source's own padding: "
                     "no token of the tokenizer reaches them")
    return notes


def _json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"
