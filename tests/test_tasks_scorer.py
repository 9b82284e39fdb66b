"""The downstream scorer against answers known without running a real model: a hand-built model whose next-token
log-probabilities are a fixed table (by the previous token and the position), a tiny BPE tokenizer with one
merge, and hand-made scores for the metrics. Plus: batched scoring of a real Transformer equals one pair at a
time, and 1, 2 and 3 gloo ranks give the same numbers."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import run_ranks

from nanopt.evaluate.tasks.catalog import TASKS, Example
from nanopt.evaluate.tasks.metrics import task_metrics
from nanopt.evaluate.tasks.scorer import Score, encode_pairs, plan_batches, score_requests, split_context
from nanopt.runtime import Runtime, init_runtime

VOCAB = {"<eos>": 0, "x": 1, "a": 2, "b": 3, "c": 4, " ": 5, "ab": 6, "y": 7}


def bpe_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(vocab=VOCAB, merges=[("a", "b")]))  # "ab" merges: a boundary that moves
    tok.add_special_tokens(["<eos>"])
    return tok


class FixedModel(torch.nn.Module):
    """Logits at position t: table[previous token] + shift[t]. Refuses inputs longer than its positions, as the
    Transformer does."""

    def __init__(self, positions: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(len(VOCAB), len(VOCAB), generator=gen) * 3
        self.shift = torch.randn(positions, len(VOCAB), generator=gen)
        self.positions = positions

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        assert inputs.shape[1] <= self.positions
        return self.table[inputs] + self.shift[: inputs.shape[1]]

    def logprob(self, previous: int, position: int, token: int) -> float:
        return float((self.table[previous] + self.shift[position]).log_softmax(-1)[token])

    def greedy(self, previous: int, position: int) -> int:
        return int((self.table[previous] + self.shift[position]).argmax())


def cpu() -> Runtime:
    return Runtime(device=torch.device("cpu"), rank=0, local_rank=0, world_size=1, precision="fp32")


def expected(model: FixedModel, tokens: list[int], scored: int) -> tuple[float, bool]:
    """Sum of log-probabilities of the last `scored` tokens, by hand; tokens start at position 0."""
    ll, greedy = 0.0, True
    for t in range(len(tokens) - scored, len(tokens)):
        ll += model.logprob(tokens[t - 1], t - 1, tokens[t])
        greedy &= model.greedy(tokens[t - 1], t - 1) == tokens[t]
    return ll, greedy


def test_the_boundary_rule_is_the_harness_rule():
    tok = bpe_tokenizer()
    # Trailing whitespace of the context moves to the continuation.
    assert split_context("x ", "b") == ("x", " b")
    assert split_context("x", " b") == ("x", " b")
    (moved,) = encode_pairs(tok, [("x ", "b")], eos_id=0, max_positions=16)
    assert moved.tokens == (1, 5, 3) and moved.scored == 2
    # "xa" + "bc" encodes whole as x|ab|c: the continuation is what follows the context's own 2 tokens (x|a),
    # c alone, and the model reads the context's tokens then it (x|a|c), exactly as the harness builds its input
    # from context_enc + continuation_enc: the "b" that merged across the boundary is not scored.
    (merged,) = encode_pairs(tok, [("xa", "bc")], eos_id=0, max_positions=16)
    assert merged.tokens == (1, 2, 4) and merged.scored == 1
    # An empty context is the end-of-text token.
    (empty,) = encode_pairs(tok, [("", "xy")], eos_id=0, max_positions=16)
    assert empty.tokens == (0, 1, 7) and empty.scored == 2


def test_log_likelihoods_are_the_tables_including_left_truncation():
    tok = bpe_tokenizer()
    model = FixedModel(positions=6)
    pairs = [("x", " a"), ("xa", "bc"), ("x ", "b"), ("xyxyxyxyxy", " c"), ("y", "xyxyxyxyc"), ("", "abc")]
    requests = encode_pairs(tok, pairs, eos_id=0, max_positions=6)
    assert max(len(r.tokens) for r in requests) == 7  # truncated to positions + 1 on the left
    long_context = requests[3]
    assert long_context.tokens == (7, 1, 7, 1, 7, 5, 4)  # the last 7 of x y x y x y x y x y " " c
    scores = score_requests(model, cpu(), requests, micro_batch_size=4, max_positions=6)
    for r, s in zip(requests, scores, strict=True):
        ll, greedy = expected(model, list(r.tokens), r.scored)
        assert s.loglikelihood == pytest.approx(ll, abs=1e-9)
        assert s.greedy == greedy and s.tokens == r.scored
    # A continuation longer than the positions keeps its last `positions` tokens.
    assert requests[4].scored == 6


def mc_task(kind: str = "choice"):
    return next(t for t in TASKS.values() if t.kind == kind)


def test_acc_acc_norm_and_acc_per_token_pick_differently():
    # Choice 0: ll -6 over 2 characters and 3 tokens; choice 1: ll -8 over 8 characters and 2 tokens.
    # acc: 0 (-6 > -8); acc_norm: 1 (-1 > -3 per character); per token: 0 (-2 > -4).
    example = Example(pairs=(("c", " ab"), ("c", " abcdefg")), gold=1, norm_chars=(2, 8))
    scores = [Score(-6.0, False, 3), Score(-8.0, False, 2)]
    r = task_metrics(mc_task(), [example], scores)
    assert (r["acc"]["value"], r["acc_norm"]["value"], r["acc_per_token"]["value"]) == (0.0, 1.0, 0.0)
    # Ties go to the first choice, as numpy's argmax.
    tie = task_metrics(mc_task(), [Example(pairs=(("c", " a"), ("c", " b")), gold=1, norm_chars=(1, 1))],
                       [Score(-1.0, False, 1), Score(-1.0, False, 1)])
    assert tie["acc"]["value"] == 0.0


def test_stderr_centered_and_lambada():
    examples = [Example(pairs=(("c", " a"), ("c", " b")), gold=g, norm_chars=(1, 1)) for g in (0, 0, 1, 1)]
    scores = [Score(-1.0, False, 1), Score(-2.0, False, 1)] * 4  # always picks choice 0: right twice of four
    piqa = task_metrics(TASKS["piqa"], examples, scores)
    assert piqa["acc"]["value"] == 0.5 and piqa["n"] == 4
    assert piqa["acc"]["stderr"] == pytest.approx(math.sqrt(1 / 3) / 2)  # sample std (n - 1) / sqrt(n)
    assert piqa["centered"]["value"] == 0.0  # chance is 0.5
    lam = task_metrics(TASKS["lambada_openai"], [Example(pairs=(("a b", " c"),), gold=0, norm_chars=(2,))] * 2,
                       [Score(-1.0, True, 1), Score(-3.0, False, 2)])
    assert lam["acc"]["value"] == 0.5
    assert lam["perplexity"] == pytest.approx(math.exp(2.0))
    assert lam["centered"]["value"] == 0.5 and "acc_norm" not in lam


def test_batches_are_sorted_padded_and_the_same_for_any_world_size():
    lengths = [3, 9, 5, 9, 1]
    assert plan_batches(lengths, 2, 1) == [[1, 3], [2, 0], [4]]
    assert plan_batches(lengths, 2, 2) == [[1, 3], [2, 0], [4], []]
    assert plan_batches(lengths, 2, 3) == [[1, 3], [2, 0], [4]]


# ---------------------------------------------------------------------------------- a real model, 1 to 3 ranks


def tiny_transformer():
    from nanopt.config import ModelConfig
    from nanopt.model.transformer import Transformer

    torch.manual_seed(3)
    cfg = ModelConfig(architecture="llama", vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    return Transformer(cfg).eval()


PAIRS = [("x", " a"), ("xa", "bc"), ("x ", "b"), ("xyxyxyxyxy", " c"), ("y", "xyc"), ("", "abc"), ("yy", "x")] * 3


def score_on_ranks() -> list[tuple[float, bool, int]]:
    rt = init_runtime("fp32")
    requests = encode_pairs(bpe_tokenizer(), PAIRS, eos_id=0, max_positions=8)
    return [(s.loglikelihood, s.greedy, s.tokens) for s in score_requests(tiny_transformer(), rt, requests, 3, 8)]


def test_batched_scores_equal_one_pair_at_a_time():
    model = tiny_transformer()
    requests = encode_pairs(bpe_tokenizer(), PAIRS, eos_id=0, max_positions=8)
    batched = score_requests(model, cpu(), requests, micro_batch_size=4, max_positions=8)
    for r, s in zip(requests, batched, strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([r.tokens[:-1]])).log_softmax(-1)[0]
        n = len(r.tokens) - 1
        want = sum(float(logp[p, r.tokens[p + 1]]) for p in range(n - r.scored, n))
        assert s.loglikelihood == pytest.approx(want, abs=1e-5)


def test_one_two_and_three_ranks_agree():
    one = score_on_ranks()
    assert run_ranks(score_on_ranks, world_size=2) == [one, one]
    assert run_ranks(score_on_ranks, world_size=3) == [one, one, one]
