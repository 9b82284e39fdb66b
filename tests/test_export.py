"""Export: transformers loads the directory and computes the same logits; tokenizer files load and round-trip;
unsupported configs, mismatched weights and occupied destinations are refused without leaving files behind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.errors import CheckpointError, ConfigError
from nanopt.export.hf import export_hf
from nanopt.model.transformer import Transformer

transformers = pytest.importorskip("transformers")


def tiny(architecture: str, **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=211, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    base.update(overrides)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


CONFIGS = {
    "llama-gqa-untied": tiny("llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                             rms_norm_eps=1e-6),
    "llama-tied-biases": tiny("llama", attention_bias=True, mlp_bias=True, intermediate_size=80),
    "gpt2-tied": tiny("gpt2", layer_norm_eps=1e-6),
    "gpt2-untied": tiny("gpt2", tie_word_embeddings=False, intermediate_size=96),
}


def trained_looking_model(cfg: ModelConfig) -> Transformer:
    """Random init plus noise on every tensor: at init biases are 0 and norms 1, which would hide a mix-up."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def load_hf(out_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_computes_the_same_logits(name, tmp_path):
    cfg = CONFIGS[name]
    model = trained_looking_model(cfg)
    out = export_hf(cfg, model.state_dict(), None, tmp_path / "export", eos_id=0)
    hf_model = load_hf(out)
    expected_class = "LlamaForCausalLM" if cfg.architecture == "llama" else "GPT2LMHeadModel"
    assert type(hf_model).__name__ == expected_class
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        diff = (hf_model(ids).logits - model(ids)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_tied_head_is_written_once(tied, tmp_path):
    from safetensors import safe_open

    cfg = tiny("llama", tie_word_embeddings=tied)
    out = export_hf(cfg, trained_looking_model(cfg).state_dict(), None, tmp_path / "export")
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        keys = set(weights.keys())
        assert weights.metadata() == {"format": "pt"}
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) is not tied
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied and config["model_type"] == "llama"


def test_tied_state_dict_without_head_key_is_accepted(tmp_path):
    cfg = tiny("gpt2")
    model = trained_looking_model(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = export_hf(cfg, state, None, tmp_path / "export")
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    with torch.no_grad():
        assert (load_hf(out)(ids).logits - model(ids)).abs().max().item() < 1e-4


# -------------------------------------------------------------------------------------------------- tokenizer


def train_tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sentences = ["the quick brown fox jumps over the lazy dog", "a tiny model learns the shape of text",
                 "tokens, bytes and merges; nothing more", "hello world, hello tokenizer"] * 5
    tokenizer.train_from_iterator(sentences, trainer=trainer)
    tokenizer.save(str(path))


def test_tokenizer_loads_and_round_trips(tmp_path):
    train_tiny_tokenizer(tmp_path / "tokenizer.json")
    cfg = tiny("gpt2", vocab_size=320)
    out = export_hf(cfg, trained_looking_model(cfg).state_dict(), tmp_path / "tokenizer.json", tmp_path / "export")

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "the lazy fox says hello, world!"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 0  # the trainer puts special tokens first
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 0
    assert tokenizer.model_max_length == cfg.max_position_embeddings


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    train_tiny_tokenizer(tmp_path / "tokenizer.json")
    cfg = tiny("llama", vocab_size=100)
    with pytest.raises(ConfigError, match="vocab_size"):
        export_hf(cfg, trained_looking_model(cfg).state_dict(), tmp_path / "tokenizer.json", tmp_path / "export")
    assert list(tmp_path.iterdir()) == [tmp_path / "tokenizer.json"]


# ------------------------------------------------------------------------------------- refusals, atomicity


def test_gpt2_without_biases_is_refused(tmp_path):
    cfg = tiny("gpt2", mlp_bias=False)
    with pytest.raises(ConfigError, match="mlp_bias") as excinfo:
        export_hf(cfg, trained_looking_model(cfg).state_dict(), None, tmp_path / "export")
    assert excinfo.value.hint
    assert not any(tmp_path.iterdir())


def test_mismatched_weights_are_refused_and_leave_nothing(tmp_path):
    cfg = tiny("llama")
    state = trained_looking_model(tiny("llama", hidden_size=32)).state_dict()
    with pytest.raises(CheckpointError, match="shape"):
        export_hf(cfg, state, None, tmp_path / "export")
    state = trained_looking_model(cfg).state_dict()
    del state["layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing layers\.1\.mlp\.up_proj\.weight"):
        export_hf(cfg, state, None, tmp_path / "export")
    assert not any(tmp_path.iterdir())


def test_an_earlier_export_needs_force_and_is_replaced_whole_but_other_files_never(tmp_path):
    cfg = tiny("llama")
    state = trained_looking_model(cfg).state_dict()
    out = export_hf(cfg, state, None, tmp_path / "export")
    with pytest.raises(ConfigError, match="not empty"):
        export_hf(cfg, state, None, out)

    export_hf(cfg, state, None, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no staging or set-aside directory left

    (out / "stale.txt").write_text("someone's notes")  # no longer only what nanopt wrote: never replaced
    with pytest.raises(ConfigError, match="not a nanopt export"):
        export_hf(cfg, state, None, out, force=True)
    assert (out / "stale.txt").read_text() == "someone's notes"


@pytest.mark.parametrize("name", ["gpt2-tied", "llama-gqa-untied"])
def test_vocab_padded_past_the_tokenizer_is_sliced_back(name, tmp_path):
    """A model vocab padded for fast GEMMs (GPT-2's 50257 -> 50304) exports with the tokenizer's vocab: the extra
    embedding and head rows are never a token, and transformers would otherwise size its vocab by them."""
    from safetensors import safe_open

    train_tiny_tokenizer(tmp_path / "tokenizer.json")
    real_vocab = 300
    cfg = dataclasses.replace(CONFIGS[name], vocab_size=384)
    model = trained_looking_model(cfg)
    out = export_hf(cfg, model.state_dict(), tmp_path / "tokenizer.json", tmp_path / "export")

    assert json.loads((out / "config.json").read_text())["vocab_size"] == real_vocab
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        row_counts = {key: weights.get_slice(key).get_shape()[0] for key in weights.keys()
                      if key.endswith(("wte.weight", "embed_tokens.weight", "lm_head.weight"))}
    assert row_counts and set(row_counts.values()) == {real_vocab}, row_counts
    hf_model = load_hf(out)
    ids = torch.randint(0, real_vocab, (2, 40))
    with torch.no_grad():
        hf_logits, ours = hf_model(ids).logits, model(ids)
    assert hf_logits.shape[-1] == real_vocab
    assert (hf_logits - ours[..., :real_vocab]).abs().max().item() < 1e-4


# model.json options and the transformers model that has each: Qwen2 (biases on q/k/v only), Qwen3 (qk-norm)
OPTION_CONFIGS = {
    "Qwen2ForCausalLM": tiny("llama", qkv_bias=True, attention_bias=False, num_key_value_heads=2),
    "Qwen3ForCausalLM": tiny("llama", qk_norm=True, num_key_value_heads=2, tie_word_embeddings=False),
    "Qwen3ForCausalLM-biases": tiny("llama", qk_norm=True, attention_bias=True, init="fan_in"),
    "LlamaForCausalLM-fan-in": tiny("llama", init="fan_in", mlp_bias=True),
    "GPT2LMHeadModel-document-masking": tiny("gpt2", document_masking=True, eos_token_id=0),
}


@pytest.mark.parametrize("name", OPTION_CONFIGS)
def test_model_options_export_to_the_transformers_model_that_has_them(name, tmp_path):
    cfg = OPTION_CONFIGS[name]
    model = trained_looking_model(cfg)
    hf_model = load_hf(export_hf(cfg, model.state_dict(), None, tmp_path / "export", eos_id=0))
    assert type(hf_model).__name__ == name.split("-")[0]
    ids = torch.randint(1, cfg.vocab_size, (2, 40))  # one document: no EOS (id 0) inside
    with torch.no_grad():
        assert (hf_model(ids).logits - model(ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize(("overrides", "named"), [
    (dict(architecture="gpt2", qkv_bias=False), "qkv_bias"),
    (dict(architecture="gpt2", qk_norm=True), "qk_norm"),
    (dict(architecture="llama", qk_norm=True, mlp_bias=True), "qk_norm"),
    (dict(architecture="llama", qkv_bias=False, attention_bias=True), "qkv_bias"),
])
def test_options_no_transformers_model_has_are_refused_in_one_line(overrides, named, tmp_path):
    cfg = tiny(**overrides)
    with pytest.raises(ConfigError, match=f"key '{named}'") as excinfo:
        export_hf(cfg, trained_looking_model(cfg).state_dict(), None, tmp_path / "export")
    assert excinfo.value.hint and "\n" not in str(excinfo.value)
    assert not any(tmp_path.iterdir())
