"""model.json's recipe options: qkv_bias (biases per projection), qk_norm, init "fan_in". Each exact in the parameter
count (the built model's), counted by the memory model as autograd saves it, and invisible when left out (a
checkpoint from before them means the same model)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.model import memory as memory_model
from nanopt.model.flops import count_params, flops_per_token
from nanopt.model.transformer import Transformer
from nanopt.train.checkpoint.resume import config_differences


def tiny(**overrides) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    cfg = ModelConfig(**{**base, **overrides})
    cfg.validate()
    return cfg


def built_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def test_published_gpt2_163m_variant_count():
    # GPT-2 small with the tokenizer's 50257 rows, an untied head and no biases on q, k, v (o_proj, the MLP and
    # the LayerNorms keep theirs): the 163,009,536 parameters a published GPT-2 163M run reported.
    cfg = ModelConfig(architecture="gpt2", vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, max_position_embeddings=1024, tie_word_embeddings=False,
                      qkv_bias=False)
    assert count_params(cfg).total == 163_009_536 == built_count(cfg)
    with_qkv = dataclasses.replace(cfg, qkv_bias=None)  # GPT-2's own biases everywhere
    assert count_params(with_qkv).total - count_params(cfg).total == 12 * 3 * 768


@pytest.mark.parametrize("overrides", [
    dict(qk_norm=True), dict(qkv_bias=True), dict(qkv_bias=True, attention_bias=False, mlp_bias=True),
    dict(architecture="gpt2", num_key_value_heads=4, qkv_bias=False, qk_norm=True),
    dict(qkv_bias=False, attention_bias=True, qk_norm=True, tie_word_embeddings=False),
])
def test_count_and_flops_follow_each_option_exactly(overrides):
    cfg = tiny(**overrides)
    assert count_params(cfg).total == built_count(cfg)
    plain = tiny(**{k: v for k, v in overrides.items() if k not in ("qk_norm", "qkv_bias")})
    extra = count_params(cfg).total - count_params(plain).total
    assert flops_per_token(cfg, 64) - flops_per_token(plain, 64) == 6 * extra


def saved_bytes(cfg: ModelConfig, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one fp32 forward on the CPU."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    storages: dict[int, int] = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(ids, ids)
    return sum(storages.values())


def test_memory_model_counts_what_qk_norm_saves():
    ids = torch.randint(0, 256, (2, 64))
    measured = saved_bytes(tiny(qk_norm=True), ids) - saved_bytes(tiny(), ids)

    def predicted(cfg):
        return memory_model.activation_bytes_per_token_per_layer(cfg, 4, compiled=False)

    per_token_layer = predicted(tiny(qk_norm=True)) - predicted(tiny())
    assert per_token_layer > 0
    # the norms' own weights (2 x head_dim per layer) are saved too, and are no activation
    assert abs(measured - per_token_layer * 2 * 64 * 2) <= 2 * 2 * 16 * 4


def fan_in_std(model: Transformer, name: str) -> float:
    return dict(model.named_parameters())[name].std().item()


def test_fan_in_init_draws_one_over_sqrt_fan_in_with_the_depth_scaling():
    cfg = tiny(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
               num_hidden_layers=4, init="fan_in", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(cfg)
    depth = 1 / math.sqrt(2 * 4)
    expected = {"layers.0.attn.q_proj.weight": 1 / math.sqrt(512), "layers.0.mlp.up_proj.weight": 1 / math.sqrt(512),
                "layers.0.attn.o_proj.weight": depth / math.sqrt(512),
                "layers.0.mlp.down_proj.weight": depth / math.sqrt(1024),
                "embed_tokens.weight": 0.02, "lm_head.weight": 0.02}
    for name, std in expected.items():
        assert abs(fan_in_std(model, name) / std - 1) < 0.05, name
    torch.manual_seed(0)
    normal = Transformer(dataclasses.replace(cfg, init="normal"))
    assert abs(fan_in_std(normal, "layers.0.attn.q_proj.weight") / 0.02 - 1) < 0.05


def test_a_checkpoint_from_before_the_options_is_the_same_model():
    cfg = tiny()
    old_snapshot = {key: value for key, value in cfg.to_dict().items()
                    if key not in ("qkv_bias", "qk_norm", "init", "document_masking", "eos_token_id")}
    assert config_differences({"model": old_snapshot}, {"model": cfg.to_dict()}) == []
    changed = config_differences({"model": old_snapshot}, {"model": tiny(qk_norm=True).to_dict()})
    assert changed == [("model.qk_norm", False, True)]


def test_bad_option_values_are_config_errors(tmp_path):
    from nanopt.config import load_model_config
    from nanopt.errors import ConfigError

    path = tmp_path / "model.json"
    base = '"architecture": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, ' \
           '"num_attention_heads": 2, "max_position_embeddings": 16'
    for extra, named in (('"init": "xavier"', "init"), ('"qk_norm": "yes"', "qk_norm"),
                         ('"document_masking": true', "document_masking"), ('"eos_token_id": 64', "eos_token_id")):
        path.write_text("{" + base + ", " + extra + "}")
        with pytest.raises(ConfigError, match=f"key '{named}'"):
            load_model_config(path)
