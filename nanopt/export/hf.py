"""Export a trained model to a Hugging Face `transformers` directory.

The directory holds config.json, model.safetensors (fp32) and, given a tokenizer, tokenizer.json,
tokenizer_config.json and special_tokens_map.json, so that `AutoModelForCausalLM.from_pretrained(dir)` and
`AutoTokenizer.from_pretrained(dir)` load it without nanopt:

- "llama" becomes LlamaForCausalLM: the weights keep their shapes, only the names change; with biases on q/k/v
  only, Qwen2ForCausalLM; with qk_norm, Qwen3ForCausalLM (nanopt.model.hf_names.hf_family).
- "gpt2" becomes GPT2LMHeadModel: its Conv1D layers store weights as [in, out], the transpose of nn.Linear, and
  its c_attn fuses the q, k and v projections into one matrix.

config.json carries both spellings that differ between transformers 4 and 5 (`torch_dtype` / `dtype`,
`rope_theta` and `rope_scaling` / `rope_parameters`), so either major version reads it. The directory is built
beside `out_dir` and renamed into place, so a failed export leaves nothing half-written. It and its files get
0755 / 0644 less the umask, so others on a shared machine can load the export and none can change it; nothing is
written through a link (nanopt.files).

`force` replaces an earlier export and nothing else: a directory is an export when it holds config.json and
model.safetensors and no entry but the files listed in EXPORT_FILES. The run directory, anything that contains it
or the current directory, a dataset, a link and any other non-empty directory are refused, and a replaced export
is deleted file by file, so nothing nanopt did not write can be lost.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nanopt.config import ModelConfig
from nanopt.data.output import is_dataset
from nanopt.errors import CheckpointError, ConfigError, DataError
from nanopt.files import copy_file, new_dir, remove_tree, write_file
from nanopt.model.hf_names import HF_CLASSES, hf_family, hf_tensors
from nanopt.model.layout import TensorSpec, few, mismatch, tensor_specs
from nanopt.rundir import RunDir
from nanopt.train.checkpoint import save_tensors

# Every file an export holds; an existing directory with anything else in it is not replaced.
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")


def export_hf(model_cfg: ModelConfig, state_dict: dict[str, Tensor], tokenizer_json: Path | None, out_dir: Path,
              eos_id: int | None = None, *, force: bool = False, run_dir: Path | None = None) -> Path:
    """Write a transformers directory for this model and return its path.

    state_dict uses nanopt's key names (see nanopt.model.transformer); with tied embeddings `lm_head.weight` may
    be present or not. eos_id defaults to the tokenizer's end-of-text token. An existing non-empty out_dir is
    refused unless it is an earlier export and force=True; it is then replaced once the new directory is
    complete. run_dir (the run exported from) is never written into or replaced.
    """
    out_dir = Path(out_dir)
    _check_destination(out_dir, force, run_dir)
    check_exportable(model_cfg)
    tokenizer_files: dict[str, Any] = {}
    vocab_size = model_cfg.vocab_size
    if tokenizer_json is not None:
        tokenizer_files, eos_id, vocab_size = _tokenizer_files(Path(tokenizer_json), model_cfg, eos_id)
    hf_state = to_hf_state_dict(model_cfg, state_dict, vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _new_sibling(out_dir, "partial")
    try:
        _write_json(staging / "config.json", hf_config(model_cfg, eos_id, vocab_size))
        _save_safetensors(hf_state, staging / "model.safetensors")
        for name, content in tokenizer_files.items():
            if isinstance(content, Path):
                copy_file(content, staging / name)
            else:
                _write_json(staging / name, content)
        _move_into_place(staging, out_dir)
    except BaseException:
        remove_tree(staging, inside=out_dir.parent, quiet=True)
        raise
    return out_dir


# ------------------------------------------------------------------------------------------------ config


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ConfigError for a model that no transformers class can represent exactly."""
    if cfg.architecture not in ("llama", "gpt2"):
        raise ConfigError(f"model.json: key 'architecture': cannot export {cfg.architecture!r}",
                          'export supports "llama" and "gpt2"')
    hf_family(cfg)


def hf_config(cfg: ModelConfig, eos_id: int | None, vocab_size: int | None = None) -> dict[str, Any]:
    """config.json contents. bos = eos: nanopt separates documents with EOS and has no separate BOS. vocab_size
    (default: the model's) is the tokenizer's when the model's vocab was padded past it (see to_hf_state_dict)."""
    common = {
        "vocab_size": cfg.vocab_size if vocab_size is None else vocab_size,
        "initializer_range": cfg.initializer_range,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    family = hf_family(cfg)
    if family != "gpt2":
        return {
            "architectures": [HF_CLASSES[family]],
            "model_type": family,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            **_rope_keys(cfg),
            # Llama and Qwen3: one switch for q/k/v/o; Qwen2 has q/k/v biases built in (and no such key)
            **({} if family == "qwen2" else {"attention_bias": cfg.attention_bias}),
            **({"mlp_bias": cfg.mlp_bias} if family == "llama" else {"use_sliding_window": False}),
            # Llama in transformers has attention dropout only; nanopt's residual dropout has no counterpart.
            "attention_dropout": cfg.dropout,
            **common,
        }
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": cfg.hidden_size,
        "n_layer": cfg.num_hidden_layers,
        "n_head": cfg.num_attention_heads,
        "n_positions": cfg.max_position_embeddings,
        "n_inner": cfg.intermediate_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "embd_pdrop": 0.0,  # nanopt applies no dropout to the embeddings
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        **common,
    }


def _rope_keys(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE in both spellings: transformers 4 reads rope_theta and rope_scaling, transformers 5 rope_parameters."""
    if cfg.rope_scaling is None:
        return {"rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": dict(cfg.rope_scaling),
            "rope_parameters": {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}}


# ----------------------------------------------------------------------------------------------- weights


def to_hf_state_dict(cfg: ModelConfig, state_dict: dict[str, Tensor], vocab_size: int | None = None
                     ) -> dict[str, Tensor]:
    """nanopt weights -> transformers names and layouts, as contiguous fp32 CPU tensors. A tied head is left out:
    transformers ties it to the embedding on load.

    vocab_size below the model's keeps only the first vocab_size rows of the embedding and the head: a vocabulary
    padded for aligned GEMMs (GPT-2's 50257 tokens in a 50304-row model) has rows that no token id reaches, and
    transformers sizes its vocabulary (generation, resize_token_embeddings) by the weights. The logits of the real
    tokens are unchanged; the padded rows, which training only ever pushed down, leave the softmax. The names and
    layouts are nanopt.model.hf_names'.
    """
    _check_state_dict(cfg, state_dict)
    state = {key: value.detach().to(device="cpu", dtype=torch.float32) for key, value in state_dict.items()}
    if vocab_size is not None and vocab_size < cfg.vocab_size:
        for key in ("embed_tokens.weight", "lm_head.weight"):
            if key in state:
                state[key] = state[key][:vocab_size]
    hf_state = {}
    for entry in hf_tensors(cfg):
        value = torch.cat([state[name] for name in entry.ours], dim=0) if len(entry.ours) > 1 else state[entry.ours[0]]
        hf_state[entry.name] = value.T if entry.transposed else value
    return {key: value.contiguous() for key, value in hf_state.items()}


def _check_state_dict(cfg: ModelConfig, state_dict: dict[str, Tensor]) -> None:
    """The weights must be exactly those of Transformer(cfg): same names, same shapes (any float dtype: they are
    written as fp32)."""
    expected = {key: TensorSpec(spec.shape) for key, spec in tensor_specs(cfg).items()}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    hint = "export with the model.json the checkpoint was trained with"
    problem = mismatch(expected, {key: TensorSpec(tuple(value.shape)) for key, value in state_dict.items()},
                       optional)
    if problem:
        raise CheckpointError(f"weights do not match model.json: {problem}", hint)
    if optional and "lm_head.weight" in state_dict and not torch.equal(state_dict["lm_head.weight"],
                                                                       state_dict["embed_tokens.weight"]):
        raise CheckpointError("model.json ties the embeddings but lm_head.weight differs from embed_tokens.weight",
                              hint)


def _save_safetensors(state: dict[str, Tensor], path: Path) -> None:
    # transformers refuses safetensors files whose metadata does not say which framework wrote them.
    save_tensors(state, path, metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------- tokenizer


def _tokenizer_files(path: Path, cfg: ModelConfig, eos_id: int | None) -> tuple[dict[str, Any], int, int]:
    """The tokenizer files to write, the EOS id (given, or the tokenizer's end-of-text token) and the tokenizer's
    vocabulary size, which the export takes when the model's vocab was padded past it."""
    from nanopt.data.tokenizers.tokenizer import read_tokenizer_file

    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found", "pass the tokenizer.json of the run's dataset")
    tokenizer = read_tokenizer_file(path, "pass the tokenizer.json of the run's dataset")
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ConfigError(f"model.json: key 'vocab_size': {cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.get_vocab_size()} tokens ({path})", "export with the run's own tokenizer")
    eos_token = _end_of_text_token(tokenizer, eos_id, path)
    eos_id = tokenizer.token_to_id(eos_token)
    special = {"bos_token": eos_token, "eos_token": eos_token, "unk_token": eos_token}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    files = {"tokenizer.json": path, "tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special}
    return files, eos_id, tokenizer.get_vocab_size()


def _end_of_text_token(tokenizer: Any, eos_id: int | None, path: Path) -> str:
    if eos_id is not None:
        token = tokenizer.id_to_token(eos_id)
        if token is None:
            raise DataError(f"{path}: EOS id {eos_id} is not in the tokenizer", "pass the dataset's EOS id")
        return token
    from nanopt.data.tokenizers.tokenizer import find_eos

    return find_eos(tokenizer, str(path))[0]  # the rule `nanopt tokenize` follows


# ---------------------------------------------------------------------------------------------- the files


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_file(path, json.dumps(data, indent=2) + "\n")


def _check_destination(out_dir: Path, force: bool, run_dir: Path | None) -> None:
    """Raise ConfigError unless out_dir is new, empty, or (with force) an earlier export."""
    _refuse_what_is_never_replaced(out_dir, run_dir)
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not _is_export(out_dir):
        if not force:
            raise ConfigError(f"{out_dir}: already exists and is not empty, and is not a nanopt export",
                              "choose another --out; --force only replaces an earlier export")
        raise ConfigError(f"{out_dir}: exists and is not a nanopt export ({_why_not_an_export(out_dir)}); "
                          "--force only replaces an earlier export", "delete it yourself or choose another --out")
    if not force:
        raise ConfigError(f"{out_dir}: already exists and is not empty (an earlier export)",
                          "pass --force to replace it, or choose another --out")


def _refuse_what_is_never_replaced(out_dir: Path, run_dir: Path | None) -> None:
    """Destinations refused with or without force, each with its own reason."""
    hint = "choose another --out" + (f", e.g. {RunDir(run_dir).export_dir} (the default)" if run_dir else "")
    if out_dir.is_symlink():
        raise ConfigError(f"{out_dir}: is a symbolic link", "pass the directory it points to, or another --out")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir}: exists and is not a directory", hint)
    blocking = next((parent for parent in out_dir.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{out_dir}: {blocking} is not a directory", hint)
    target = out_dir.resolve()
    if run_dir is not None:
        run = Path(run_dir).resolve()
        if target == run:
            raise ConfigError(f"{out_dir}: is the run directory", hint)
        if target in run.parents:
            raise ConfigError(f"{out_dir}: contains the run directory {run_dir}", hint)
    cwd = Path.cwd().resolve()
    if target == cwd:
        raise ConfigError(f"{out_dir}: is the current directory", hint)
    if target in cwd.parents:
        raise ConfigError(f"{out_dir}: contains the current directory", hint)
    if is_dataset(out_dir):
        raise ConfigError(f"{out_dir}: is a nanopt dataset", hint)


def _is_export(path: Path) -> bool:
    """Written by export_hf: config.json and model.safetensors, and no entry nanopt does not write."""
    entries = list(path.iterdir())
    names = {entry.name for entry in entries}
    regular_files = all(entry.is_file() and not entry.is_symlink() for entry in entries)
    return regular_files and names <= set(EXPORT_FILES) and {"config.json", "model.safetensors"} <= names


def _why_not_an_export(path: Path) -> str:
    foreign = sorted(e.name for e in path.iterdir()
                     if e.name not in EXPORT_FILES or not e.is_file() or e.is_symlink())
    if foreign:
        return f"it holds {few(foreign)}, which nanopt does not write"
    return "config.json or model.safetensors is missing"


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename the finished staging directory to out_dir; a previous out_dir (empty, or an export: checked by
    _check_destination) is set aside first and deleted only after the rename succeeded, so at every moment one
    complete export exists."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = _new_sibling(out_dir, "old")
    old.rmdir()  # only the unique name is wanted; rename needs the target not to exist
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        old.rename(out_dir)
        raise
    _discard_export(old)


def _new_sibling(out_dir: Path, kind: str) -> Path:
    """A new empty directory beside out_dir with a unique hidden name. Made with mkdir, not tempfile.mkdtemp: the
    staging directory becomes the export, and mkdtemp's 0700 would keep everyone else on the machine out of it."""
    while True:
        path = out_dir.parent / f".{out_dir.name}.{kind}-{secrets.token_hex(4)}"
        try:
            return new_dir(path)
        except FileExistsError:  # 2**32 names: another export's, taken by chance
            continue


def _discard_export(path: Path) -> None:
    """Delete a replaced export file by file, never a whole tree: only the files nanopt writes are removed, so if
    anything else appeared in it since the check, the set-aside directory stays (and nothing is lost)."""
    for name in EXPORT_FILES:
        (path / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not empty: something of the user's is in it; keep it
        path.rmdir()
