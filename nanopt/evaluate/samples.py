"""Samples from a trained model: one seeded continuation per prompt, decoded to text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanopt.data.dataset import TokenDataset
from nanopt.model.generate import generate
from nanopt.model.transformer import Transformer

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


def generate_samples(model: Transformer, dataset: TokenDataset, settings: SampleSettings) -> list[dict[str, Any]]:
    """One continuation per prompt, each starting a fresh document (after an EOS), decoded to text.

    Prompt i is sampled with seed + i: one shared seed would draw the same random numbers for every prompt, and a
    weak model's samples would then look alike whatever the prompt."""
    tokenizer = dataset.tokenizer()
    samples = []
    for index, prompt in enumerate(settings.prompts):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        new_ids = generate(model, [dataset.eos_id, *prompt_ids], settings.max_new_tokens, settings.temperature,
                           settings.top_k, settings.seed + index, eos_id=dataset.eos_id)
        samples.append({"prompt": prompt, "completion": _completion(tokenizer, prompt_ids, new_ids),
                        "new_tokens": len(new_ids), "ended": bool(new_ids) and new_ids[-1] == dataset.eos_id})
    return samples


def _completion(tokenizer: Any, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The new text. Decoded together with the prompt, because a byte-level token may complete a character the
    prompt began; special tokens (EOS) are dropped."""
    prompt_text = tokenizer.decode(prompt_ids)
    text = tokenizer.decode(prompt_ids + new_ids)
    return text[len(prompt_text):] if text.startswith(prompt_text) else tokenizer.decode(new_ids)
