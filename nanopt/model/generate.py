"""Sampling text from a model, one token at a time, with a KV cache.

`generate` is reproducible: a torch.Generator seeded with `seed` drives every random draw, so the same model,
prompt and settings give the same tokens. `use_cache=False` recomputes the whole prefix at every step; it is the
slow reference that the cached path must agree with. `stop_reason` says why a generation ended.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from nanopt.model.transformer import Transformer

# Why a generation ended: it emitted the end-of-text token, it produced the tokens asked for, or the prompt and its
# continuation filled the model's max_position_embeddings.
STOPPED_AT_EOS, STOPPED_AT_MAX_NEW_TOKENS, STOPPED_AT_CONTEXT_LIMIT = "eos", "max_new_tokens", "context_limit"


def generate(model: Transformer, prompt_ids: list[int] | Tensor, max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 0, eos_id: int | None = None, use_cache: bool = True) -> list[int]:
    """Continue prompt_ids with up to max_new_tokens tokens; return only the new ids.

    temperature 0 picks the most likely token (greedy); otherwise logits are divided by temperature and, with
    top_k, restricted to the k most likely tokens before sampling. Generation stops after emitting eos_id (which
    is included in the result).

    The context never exceeds the model's max_position_embeddings: a longer prompt is cropped to its last
    max_position_embeddings - 1 tokens, and generation stops early when the sequence reaches
    max_position_embeddings tokens (no sliding window), so fewer than max_new_tokens may come back
    (`stop_reason` tells). Callers that take prompts from a person check that they fit first (nanopt eval does).

    Pass the plain model (not a DDP / FSDP wrapper). It runs in eval mode under inference_mode; its previous
    train / eval mode is restored afterwards.
    """
    _check_settings(max_new_tokens, temperature, top_k)
    context = model.cfg.max_position_embeddings
    prompt = _own_document(model, _token_list(prompt_ids))[-max(1, context - 1):]
    budget = min(max_new_tokens, context - len(prompt))
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            next_logits = (_cached_stepper if use_cache else _uncached_stepper)(model, prompt, budget, device)
            return _sample_loop(next_logits, prompt, budget, temperature, top_k, eos_id, generator)
    finally:
        model.train(was_training)


def stop_reason(new_ids: list[int], max_new_tokens: int, eos_id: int | None) -> str:
    """Why `generate` returned `new_ids`: it stops after eos_id, after max_new_tokens tokens, or, with fewer and
    no eos_id, because the sequence filled the context."""
    if new_ids and new_ids[-1] == eos_id:
        return STOPPED_AT_EOS
    if len(new_ids) >= max_new_tokens:
        return STOPPED_AT_MAX_NEW_TOKENS
    return STOPPED_AT_CONTEXT_LIMIT


def _check_settings(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")


def _token_list(prompt_ids: list[int] | Tensor) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be one sequence, got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    tokens = [int(t) for t in prompt_ids]
    if not tokens:
        raise ValueError("prompt_ids must hold at least one token (e.g. the end-of-text id to start a document)")
    return tokens


# A stepper takes the tokens not yet seen by the model and returns the logits [vocab] for the next position.
Stepper = Callable[[list[int]], Tensor]


def _own_document(model: Transformer, prompt: list[int]) -> list[int]:
    """With document_masking, the prompt from the start of its last token's document: all that token sees (an EOS
    ends the document it follows). The KV cache then holds that document alone (and starts afresh after an EOS,
    _cached_stepper), so cached and uncached generation agree; without the option, the whole prompt."""
    eos = model.cfg.eos_token_id
    if not model.cfg.document_masking or eos not in prompt[:-1]:
        return prompt
    last_end = len(prompt) - 2 - prompt[-2::-1].index(eos)
    return prompt[last_end + 1:]


def _cached_stepper(model: Transformer, prompt: list[int], budget: int, device: torch.device) -> Stepper:
    cache = model.new_kv_cache(batch_size=1, max_len=len(prompt) + budget, device=device)
    fed: list[int] = []

    def step(new_tokens: list[int]) -> Tensor:
        if model.cfg.document_masking and fed and fed[-1] == model.cfg.eos_token_id:
            cache.length = 0  # the token after an EOS begins a document that sees nothing before it
        fed[:] = new_tokens
        ids = torch.tensor([new_tokens], dtype=torch.long, device=device)
        return model(ids, kv_cache=cache)[0, -1]

    return step


def _uncached_stepper(model: Transformer, prompt: list[int], budget: int, device: torch.device) -> Stepper:
    sequence: list[int] = []

    def step(new_tokens: list[int]) -> Tensor:
        sequence.extend(new_tokens)
        ids = torch.tensor([sequence], dtype=torch.long, device=device)
        return model(ids)[0, -1]

    return step


def _sample_loop(next_logits: Stepper, prompt: list[int], budget: int, temperature: float, top_k: int | None,
                 eos_id: int | None, generator: torch.Generator) -> list[int]:
    new_tokens: list[int] = []
    if budget <= 0:
        return new_tokens
    logits = next_logits(prompt)
    while True:
        token = sample_token(logits, temperature, top_k, generator)
        new_tokens.append(token)
        if token == eos_id or len(new_tokens) == budget:
            return new_tokens
        logits = next_logits([token])


def sample_token(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    """One token id from logits [vocab]: argmax at temperature 0, else a seeded draw from the tempered top-k."""
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))
