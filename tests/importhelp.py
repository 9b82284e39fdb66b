"""transformers checkpoints written here with random weights, for the `nanopt import` tests: every tensor perturbed
(norm weights and biases too) so a mapping mistake cannot hide, saved as safetensors beside a tokenizer.json."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def save(model: torch.nn.Module, directory: Path, tokenizer: Path, **kwargs) -> Path:
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    shutil.copy(tokenizer, directory / "tokenizer.json")
    return directory


def llama(vocab: int, tied: bool) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=tied, rms_norm_eps=1e-5)
    return perturbed(transformers.LlamaForCausalLM(cfg))


def gpt2(vocab: int) -> torch.nn.Module:
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return perturbed(transformers.GPT2LMHeadModel(cfg))
