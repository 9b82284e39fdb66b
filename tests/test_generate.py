"""Generation: the cached path agrees with full recomputation, seeds reproduce, EOS and context limits hold."""

from __future__ import annotations

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.model.generate import generate
from nanopt.model.transformer import Transformer


def tiny_model(architecture: str, max_position_embeddings: int = 64) -> Transformer:
    extra = {"num_key_value_heads": 2} if architecture == "llama" else {}
    # A wide init peaks the next-token distribution (untied, so it does not just echo its input): a wrong cache
    # changes the tokens visibly.
    cfg = ModelConfig(architecture=architecture, vocab_size=151, hidden_size=48, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=max_position_embeddings,
                      initializer_range=0.1, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    return Transformer(cfg)


ARCHITECTURES = ["llama", "gpt2"]
PROMPT = [5, 17, 42, 99, 3, 120, 7]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_cached_equals_recomputed(architecture):
    model = tiny_model(architecture)
    cached = generate(model, PROMPT, 24, temperature=0.0)
    recomputed = generate(model, PROMPT, 24, temperature=0.0, use_cache=False)
    assert cached == recomputed
    assert len(cached) == 24
    with torch.no_grad():
        assert cached[0] == int(model(torch.tensor([PROMPT]))[0, -1].argmax())


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("top_k", [None, 20])
def test_seeded_sampling_cached_equals_recomputed(architecture, top_k):
    model = tiny_model(architecture)
    cached = generate(model, PROMPT, 24, temperature=1.0, top_k=top_k, seed=7)
    recomputed = generate(model, PROMPT, 24, temperature=1.0, top_k=top_k, seed=7, use_cache=False)
    assert cached == recomputed


def test_same_seed_same_tokens_other_seed_other_tokens():
    model = tiny_model("llama")
    first = generate(model, PROMPT, 30, temperature=1.5, top_k=None, seed=1)
    assert generate(model, PROMPT, 30, temperature=1.5, top_k=None, seed=1) == first
    assert generate(model, PROMPT, 30, temperature=1.5, top_k=None, seed=2) != first


def test_top_k_one_is_greedy():
    model = tiny_model("gpt2")
    assert generate(model, PROMPT, 10, temperature=1.0, top_k=1, seed=3) == generate(model, PROMPT, 10,
                                                                                      temperature=0.0)


def test_stops_after_eos_and_includes_it():
    model = tiny_model("llama")
    greedy = generate(model, PROMPT, 10, temperature=0.0)
    eos = greedy[3]
    stopped = generate(model, PROMPT, 10, temperature=0.0, eos_id=eos)
    assert stopped == greedy[:greedy.index(eos) + 1]


def test_context_limit_stops_and_crops_the_prompt():
    model = tiny_model("gpt2", max_position_embeddings=16)
    assert len(generate(model, PROMPT, 50, temperature=0.0)) == 16 - len(PROMPT)
    long_prompt = list(range(1, 31))
    cropped = generate(model, long_prompt, 5, temperature=0.0, use_cache=False)
    assert cropped == generate(model, long_prompt[-15:], 5, temperature=0.0)
    assert len(cropped) == 1


def test_accepts_tensor_prompt_restores_mode_and_handles_zero_tokens():
    model = tiny_model("llama").train()
    assert generate(model, torch.tensor(PROMPT), 6, temperature=0.0) == generate(model, PROMPT, 6, temperature=0.0)
    assert model.training
    assert generate(model, PROMPT, 0) == []
    with pytest.raises(ValueError):
        generate(model, [], 5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_vocabulary_rows_are_never_sampled(temperature):
    """Rows past the tokenizer's vocabulary are padding: even with the largest logits they are never drawn."""
    cfg = tiny_model("gpt2").cfg
    torch.manual_seed(0)
    model = Transformer(cfg, tokenizer_vocab_size=100)
    with torch.no_grad():
        model.lm_head.weight[100:] = model.lm_head.weight[:100].sum(0) * 10
    new = generate(model, PROMPT, 40, temperature=temperature, top_k=None, seed=3)
    assert len(new) == 40 and max(new) < 100
