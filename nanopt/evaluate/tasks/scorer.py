"""The log-likelihood of each (context, continuation) pair under the model, as lm-evaluation-harness computes it
for its `hf` model (lm_eval/api/model.py _encode_pair, lm_eval/models/huggingface.py _loglikelihood_tokens):

- Boundary: trailing whitespace of the context moves to the start of the continuation; context + continuation is
  encoded whole and the continuation is the tokens after the context's own encoding, so a continuation that
  merges with the context's last token is scored as the tokenizer really splits the text. An empty context is the
  end-of-text token. No special tokens are added (the harness's default for causal models).
- Left truncation: the last max_position_embeddings + 1 tokens of the pair; the model reads all but the last.
- The continuation's log-likelihood is the sum of its tokens' log-probabilities; it is greedy when every token is
  the model's argmax.

Batches have a fixed shape (micro_batch_size rows, padded on the right, which a causal model never attends to;
widths from a few powers of two, so a compiled model meets a handful of shapes). Pairs are sorted by length,
longest first, and cut into batches the same way on any number of ranks; batch k runs on rank k mod world_size,
and empty batches pad the list so every rank runs the same number of forward passes (a sharded model's forward is
a collective). The only collective here is one all-reduce after the last batch: every rank ends with every
pair's numbers, bit for bit the same as on one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanopt.runtime import Runtime, all_reduce_sum_

MIN_WIDTH = 16


@dataclass(frozen=True)
class Request:
    tokens: tuple[int, ...]  # the pair's tokens after left truncation: the model reads tokens[:-1]
    scored: int  # the last `scored` tokens are the continuation's


@dataclass(frozen=True)
class Score:
    loglikelihood: float  # sum over the continuation's tokens, in nats
    greedy: bool  # every continuation token was the model's most likely next token
    tokens: int  # continuation tokens scored


def split_context(context: str, continuation: str) -> tuple[str, str]:
    """The harness's rule: trailing whitespace of the context belongs to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        return context[:-spaces], context[-spaces:] + continuation
    return context, continuation


def encode_pairs(tokenizer: Any, pairs: Sequence[tuple[str, str]], eos_id: int,
                 max_positions: int) -> list[Request]:
    """Each pair's tokens, split at the harness's boundary and truncated on the left to the model's positions."""
    moved = [split_context(c, x) for c, x in pairs]
    with_context = [i for i, (c, _) in enumerate(moved) if c]
    wholes = _encode(tokenizer, [moved[i][0] + moved[i][1] for i in with_context])
    contexts = _encode(tokenizer, [moved[i][0] for i in with_context])
    encoded: dict[int, tuple[list[int], list[int]]] = {
        i: (ctx, whole[len(ctx):]) for i, ctx, whole in zip(with_context, contexts, wholes, strict=True)}
    empty = [i for i, (c, _) in enumerate(moved) if not c]
    for i, cont in zip(empty, _encode(tokenizer, [moved[i][1] for i in empty]), strict=True):
        encoded[i] = ([eos_id], cont)
    return [request(*encoded[i], max_positions) for i in range(len(pairs))]


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)] if texts else []


def request(context: list[int], continuation: list[int], max_positions: int) -> Request:
    tokens = (context + continuation)[-(max_positions + 1):]
    return Request(tokens=tuple(tokens), scored=min(len(continuation), len(tokens) - 1))


def width_for(length: int, max_positions: int) -> int:
    """The batch width for inputs of up to `length` tokens: a power of two (at least MIN_WIDTH), capped."""
    return min(max_positions, max(MIN_WIDTH, 1 << max(0, length - 1).bit_length()))


def plan_batches(lengths: Sequence[int], micro_batch_size: int, world_size: int) -> list[list[int]]:
    """Indices per batch, longest first (ties by index), padded with empty batches to a multiple of world_size.
    The batches do not depend on world_size, so neither do the numbers."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches = [order[i:i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    return batches + [[] for _ in range(-len(batches) % world_size)]


@torch.no_grad()
def score_requests(model: torch.nn.Module, rt: Runtime, requests: Sequence[Request], micro_batch_size: int,
                   max_positions: int, width: int | None = None) -> list[Score]:
    """Every request's Score, on every rank; each rank runs its share of the batches. `width`: every batch that
    wide (requests no longer than it), one shape for a compiled model; None: by length."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(requests), 2, dtype=torch.float64, device=rt.device)  # (log-likelihood, misses)
    batches = plan_batches([len(r.tokens) - 1 for r in requests], micro_batch_size, rt.world_size)
    for batch in batches[rt.rank::rt.world_size]:
        _score_batch(model, rt, [requests[i] for i in batch], batch, micro_batch_size, max_positions, totals, width)
    all_reduce_sum_(rt, totals)
    model.train(was_training)
    values = totals.cpu().tolist()
    return [Score(loglikelihood=ll, greedy=misses == 0, tokens=r.scored)
            for (ll, misses), r in zip(values, requests, strict=True)]


def _score_batch(model: torch.nn.Module, rt: Runtime, batch: list[Request], owners: list[int],
                 micro_batch_size: int, max_positions: int, totals: torch.Tensor, width: int | None) -> None:
    width = width or width_for(max((len(r.tokens) - 1 for r in batch), default=1), max_positions)
    inputs = torch.zeros(micro_batch_size, width, dtype=torch.long)
    rows, cols, targets, owner = [], [], [], []
    for row, (r, index) in enumerate(zip(batch, owners, strict=True)):
        n = len(r.tokens) - 1
        inputs[row, :n] = torch.tensor(r.tokens[:-1], dtype=torch.long)
        rows += [row] * r.scored
        cols += range(n - r.scored, n)
        targets += r.tokens[len(r.tokens) - r.scored:]
        owner += [index] * r.scored
    with rt.autocast():
        logits = model(inputs.to(rt.device, non_blocking=True))  # an empty batch runs too: equal work per rank
    if not rows:
        return
    device = rt.device
    picked = logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].float().log_softmax(-1)
    target = torch.tensor(targets, device=device)
    logprob = picked.gather(1, target[:, None]).squeeze(1).double()
    misses = (picked.argmax(-1) != target).double()
    index = torch.tensor(owner, device=device)
    totals[:, 0].index_add_(0, index, logprob)
    totals[:, 1].index_add_(0, index, misses)
