"""The model: shapes, state-dict names, init, parameter counts, the chunked loss, the KV cache, compile-ability."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanopt.config import ModelConfig
from nanopt.model.flops import count_params
from nanopt.model.loss import chunked_cross_entropy
from nanopt.model.transformer import Transformer


def tiny(architecture: str, **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=211, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    if architecture == "llama":
        base.update(num_key_value_heads=2, intermediate_size=96)
    base.update(overrides)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg)


TINY_CONFIGS = {
    "llama-gqa-tied": tiny("llama"),
    "llama-mha-untied-bias": tiny("llama", num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True,
                                  mlp_bias=True),
    "gpt2-tied": tiny("gpt2"),
    "gpt2-untied": tiny("gpt2", tie_word_embeddings=False),
}


# ------------------------------------------------------------------------------------------------ structure


def test_state_dict_keys_llama():
    model = build(tiny("llama", num_hidden_layers=1, tie_word_embeddings=False))
    assert set(model.state_dict()) == {
        "embed_tokens.weight", "layers.0.attn_norm.weight", "layers.0.attn.q_proj.weight",
        "layers.0.attn.k_proj.weight", "layers.0.attn.v_proj.weight", "layers.0.attn.o_proj.weight",
        "layers.0.mlp_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight", "norm.weight", "lm_head.weight"}
    assert model.state_dict()["layers.0.attn.k_proj.weight"].shape == (2 * 16, 64)  # 2 kv heads of 16


def test_state_dict_keys_gpt2():
    model = build(tiny("gpt2", num_hidden_layers=1))
    names = {"attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp_norm", "mlp.up_proj",
             "mlp.down_proj"}
    expected = {f"layers.0.{n}.{p}" for n in names for p in ("weight", "bias")}
    expected |= {"embed_tokens.weight", "embed_positions.weight", "norm.weight", "norm.bias", "lm_head.weight"}
    assert set(model.state_dict()) == expected


def test_tied_head_is_the_embedding_parameter():
    tied = build(tiny("llama"))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    untied = build(tiny("llama", tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.embed_tokens.weight


def test_init_is_deterministic_and_follows_the_convention():
    cfg = tiny("gpt2", hidden_size=256, intermediate_size=1024, initializer_range=0.05)
    first, second = build(cfg, seed=3), build(cfg, seed=3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    state = first.state_dict()
    assert torch.all(state["layers.0.attn.q_proj.bias"] == 0)
    assert torch.all(state["layers.1.mlp_norm.weight"] == 1) and torch.all(state["norm.bias"] == 0)
    assert state["layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.05, rel=0.05)
    residual_std = 0.05 / (2 * cfg.num_hidden_layers) ** 0.5
    assert state["layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert state["layers.1.attn.o_proj.weight"].std().item() == pytest.approx(residual_std, rel=0.05)


def test_meta_build_then_materialize_keeps_tying_and_inits():
    cfg = tiny("llama")
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.all(model.norm.weight == 1)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert torch.isfinite(model(ids)).all()
    # The RoPE tables are no state-dict entries: init_weights fills them, so the same weights give the same logits
    # as a model built on the CPU.
    direct = build(cfg)
    direct.load_state_dict(model.state_dict())
    assert torch.equal(model(ids), direct(ids))


@pytest.mark.slow  # ~10 s of a 2-core CPU: make test keeps under its 5 minutes
def test_compiled_llama_reads_rope_from_tables_instead_of_computing_cos_and_sin():
    """RoPE's cos and sin come from tables built with the model. Computed in the forward, Inductor folded them into
    every layer's rotation and recomputed them in the backward too: 16 kernels a step of transcendentals for the 1B
    Llama, 3% of its step on an H100. The traced training graphs must hold no cos or sin."""
    from torch._dynamo.backends.common import aot_autograd

    seen: list[str] = []

    def record(graph: torch.fx.GraphModule, _inputs):
        seen.extend(str(node.target) for node in graph.graph.nodes if node.op == "call_function")
        return graph.forward

    for document_masking in (False, True):  # a slice of the tables, and per-row positions gathered from them
        cfg = tiny("llama", document_masking=document_masking, eos_token_id=3)
        model = build(cfg)
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
        loss = compiled(ids, ids)
        loss.backward()
        assert torch.allclose(loss, model(ids, ids), atol=1e-6)
    assert any("mm" in target for target in seen)  # the graphs were recorded
    assert not [target for target in seen if target.startswith(("aten.cos", "aten.sin"))]


# ------------------------------------------------------------------------------------------ parameter counts

GPT2_SMALL = ModelConfig(architecture="gpt2", vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, max_position_embeddings=1024)
LLAMA_1B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=2048, tie_word_embeddings=True)


def meta_param_count(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("cfg", "expected"), [(GPT2_SMALL, 124_439_808), (LLAMA_1B, 1_235_814_400)],
                         ids=["gpt2-small", "llama-1b"])
def test_parameter_count_of_known_shapes(cfg, expected):
    assert meta_param_count(cfg) == expected


@pytest.mark.parametrize("cfg", [GPT2_SMALL, LLAMA_1B, *TINY_CONFIGS.values()],
                         ids=["gpt2-small", "llama-1b", *TINY_CONFIGS])
def test_parameter_count_matches_closed_form(cfg):
    assert meta_param_count(cfg) == count_params(cfg).total


# ----------------------------------------------------------------------------------------------------- loss


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_chunked_loss_equals_full_cross_entropy(name):
    cfg = TINY_CONFIGS[name]
    model = build(cfg)
    model.loss_chunk_rows = 7  # 3 x 20 = 60 rows: eight full chunks and a ragged one
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    targets = torch.randint(0, cfg.vocab_size, (3, 20))
    targets[0, :9] = -100

    loss = model(ids, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    reference.backward()

    assert loss.dtype == torch.float32 and loss.shape == ()
    assert (loss - reference).abs().item() < 1e-6
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=0, atol=1e-6), n


@pytest.mark.parametrize("chunk_rows", [7, None], ids=["chunked", "whole"])
@pytest.mark.parametrize("name", ["llama-gqa-tied", "gpt2-untied"])
def test_padded_vocabulary_rows_are_out_of_the_logits_and_the_loss(name, chunk_rows):
    """A model of 211 rows for a 200-token tokenizer has 200 logits (what the export's 200 rows give), its loss
    is the cross-entropy over them, and its padded rows get no gradient, even when their logits are the largest."""
    cfg, tokens = TINY_CONFIGS[name], 200
    torch.manual_seed(0)
    padded = Transformer(cfg, tokenizer_vocab_size=tokens)
    padded.loss_chunk_rows = chunk_rows
    with torch.no_grad():
        padded.lm_head.weight[tokens:] = padded.lm_head.weight[:tokens].sum(0) * 10  # would win every softmax
    torch.manual_seed(1)
    ids = torch.randint(0, tokens, (3, 20))
    targets = torch.randint(0, tokens, (3, 20))
    targets[0, :9] = -100

    logits = padded(ids)
    assert logits.shape == (3, 20, tokens)
    loss = padded(ids, targets)
    loss.backward()
    reference = F.cross_entropy(logits.detach().float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert (loss - reference).abs().item() < 1e-5
    head_grad = padded.lm_head.weight.grad
    assert head_grad[tokens:].abs().max().item() == 0 and head_grad[:tokens].abs().max().item() > 0


def test_tokenizer_vocab_size_past_the_model_is_refused():
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        Transformer(TINY_CONFIGS["gpt2-tied"], tokenizer_vocab_size=212)


def test_chunked_loss_saves_no_logits_for_backward():
    # Every tensor autograd keeps for backward passes through this hook. Logits
    # (or their log-softmax) would be [rows, vocab]; the loss forms its gradients chunk by chunk, so none is kept.
    rows, hidden_size, vocab = 256, 64, 211
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    saved_shapes = []

    def record(tensor):
        saved_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_rows=32)
    loss.backward()
    assert saved_shapes, "the hook saw nothing; the test would pass vacuously"
    assert not [shape for shape in saved_shapes if shape[-1:] == (vocab,)]
    assert hidden.grad is not None and weight.grad is not None


def test_chunked_loss_all_ignored_is_nan_like_cross_entropy():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    targets = torch.full((4,), -100)
    assert torch.isnan(chunked_cross_entropy(hidden, weight, targets, chunk_rows=3))
    assert torch.isnan(F.cross_entropy(hidden @ weight.T, targets))


def test_loss_under_bf16_autocast_is_fp32_and_close():
    cfg = tiny("llama")
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    fp32_loss = model(ids, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_loss = model(ids, targets)
        assert model(ids).dtype == torch.bfloat16
    bf16_loss.backward()
    assert bf16_loss.dtype == torch.float32
    assert abs(bf16_loss.item() - fp32_loss.item()) < 2e-2
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_forward_has_no_graph_breaks_under_compile():
    # fullgraph=True fails on any host sync (.item()) or data-dependent Python branch. aot_eager traces forward and
    # backward like inductor does, without the minute of C++ compilation.
    cfg = tiny("llama")
    model = build(cfg)
    model.loss_chunk_rows = 8
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    expected = model(ids, targets)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(ids, targets)
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-6)


# ---------------------------------------------------------------------------------- attention, cache, dropout


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_causal_future_tokens_do_not_change_past_logits(name):
    cfg = TINY_CONFIGS[name]
    model = build(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % cfg.vocab_size
    before, after = model(ids), model(changed)
    assert torch.allclose(before[:, :8], after[:, :8], atol=1e-6)
    assert not torch.allclose(before[:, 8:], after[:, 8:], atol=1e-3)


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_kv_cache_logits_match_full_forward(name):
    cfg = TINY_CONFIGS[name]
    model = build(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 15))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_kv_cache(batch_size=2, max_len=20, device="cpu", dtype=torch.float32)
        # prefill, then one token at a time, then several tokens at a nonzero offset (the explicit-mask path)
        pieces = [model(ids[:, :6], kv_cache=cache)]
        pieces += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(6, 10)]
        pieces.append(model(ids[:, 10:], kv_cache=cache))
    assert cache.length == 15
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


def test_too_long_input_is_refused():
    cfg = tiny("gpt2", max_position_embeddings=16)
    model = build(cfg)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = model.new_kv_cache(1, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="KV cache"):
        model(torch.zeros(1, 9, dtype=torch.long), kv_cache=cache)


def test_dropout_only_in_training():
    cfg = tiny("llama", dropout=0.3)
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    model.train()
    assert not torch.allclose(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


# ------------------------------------------------------------------------------------------ attention kernels


def test_cudnn_attention_preference_is_switchable_and_off_the_gpu_changes_nothing():
    # cuDNN attention is preferred by default on Hopper only; a CPU run never asks for it, and asking for it
    # explicitly (what a GPU comparison does) still computes the same attention, compiled in one graph too.
    from nanopt.model.transformer import cudnn_attention_by_default

    assert cudnn_attention_by_default(torch.device("cpu")) is False
    cfg = tiny("llama")
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    default = model(ids, targets)
    model.prefer_cudnn_attention(True)
    assert all(layer.attn.prefer_cudnn is True for layer in model.layers)
    preferred = model(ids, targets)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, targets)
    model.prefer_cudnn_attention(False)
    assert torch.equal(default, preferred) and torch.allclose(compiled, default, atol=1e-6)
