"""Samples from a trained model: one seeded continuation per prompt, decoded to text, with why it stopped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanopt.errors import ConfigError
from nanopt.model.generate import STOPPED_AT_EOS, generate, stop_reason
from nanopt.model.transformer import Transformer
from nanopt.parsing import show_value

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


def check_prompts_fit(tokenizer: Any, settings: SampleSettings, max_positions: int) -> None:
    """ConfigError for a prompt that leaves no position for a new token: with the end-of-text token that starts
    its document it fills the model's max_position_embeddings. Called before any evaluation work, so a prompt that
    cannot be continued costs nothing (generation would otherwise crop it and return one token, or none)."""
    for prompt in settings.prompts:
        tokens = len(_encode(tokenizer, prompt))
        if 1 + tokens >= max_positions:
            raise ConfigError(f"--prompt {show_value(prompt)} is {tokens:,} tokens: {tokens + 1:,} positions with the "
                              "end-of-text token that starts a document, and the model's context holds "
                              f"{max_positions:,} positions (max_position_embeddings), so there is no room for a new "
                              "token",
                              f"shorten the prompt to at most {max(0, max_positions - 2):,} tokens")


def generate_samples(model: Transformer, tokenizer: Any, eos_id: int, settings: SampleSettings) -> list[dict[str, Any]]:
    """One continuation per prompt, each starting a fresh document (after an EOS), decoded to text; each says how
    many tokens it produced and why it stopped (`eos`, `max_new_tokens` or `context_limit`).

    Prompt i is sampled with seed + i: one shared seed would draw the same random numbers for every prompt, and a
    weak model's samples would then look alike whatever the prompt."""
    samples = []
    for index, prompt in enumerate(settings.prompts):
        prompt_ids = _encode(tokenizer, prompt)
        new_ids = generate(model, [eos_id, *prompt_ids], settings.max_new_tokens, settings.temperature,
                           settings.top_k, settings.seed + index, eos_id=eos_id)
        stopped = stop_reason(new_ids, settings.max_new_tokens, eos_id)
        samples.append({"prompt": prompt, "completion": _completion(tokenizer, prompt_ids, new_ids),
                        "prompt_tokens": len(prompt_ids), "new_tokens": len(new_ids), "stopped": stopped,
                        "ended": stopped == STOPPED_AT_EOS})
    return samples


def _encode(tokenizer: Any, prompt: str) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=False).ids


def _completion(tokenizer: Any, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The new text. Decoded together with the prompt, because a byte-level token may complete a character the
    prompt began; special tokens (EOS) are dropped."""
    prompt_text = tokenizer.decode(prompt_ids)
    text = tokenizer.decode(prompt_ids + new_ids)
    return text[len(prompt_text):] if text.startswith(prompt_text) else tokenizer.decode(new_ids)
