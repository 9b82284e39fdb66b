"""The model a plan trains: its sequence length, and the most balanced shape of the family near the compute-optimal
parameter count (nanopt.plan.estimate.budget's widths, heads and MLP rule, which `estimate --flops` uses too).

A plan goes further than `estimate --flops` in three ways, each for a model that trains well at that size:
- at least MIN_LAYERS blocks: one block is no transformer anyone would train;
- for Llama, the grouping of query heads per KV head is chosen with the width (4 as Llama 3, down to 2 and 1 for
  the small widths a budget of minutes buys), instead of Llama 3's alone, whose grid starts at 256 wide;
- the sequence length: the family's (2048 for Llama, 1024 for GPT-2), halved while the rule's batch would hold
  fewer than SEQUENCES_PER_GPU sequences per GPU, so a small budget's batch is not one or two long sequences.
"""

from __future__ import annotations

import dataclasses
import math

from nanopt.config import ModelConfig
from nanopt.model.flops import count_params
from nanopt.plan.estimate.budget import FAMILY_TEMPLATES, MAX_LAYERS, TARGET_ASPECT, closest_width, shape, widths

FAMILY_SEQ_LEN = {"llama": 2048, "gpt2": 1024}
MIN_SEQ_LEN = 64
SEQUENCES_PER_GPU = 8
MIN_LAYERS = 2
GROUPS = {"llama": (4, 2, 1), "gpt2": (1,)}
# The smallest sensible model may be this many times the compute-optimal size and still be planned (the loss is
# flat near the optimum: twice the parameters on half the tokens costs little); more, and the budget is too small.
TOO_SMALL = 2.0
LOOSE_TOLERANCE = 0.10
COUNT_WEIGHT = 3.0


class TooSmall(Exception):
    """The smallest sensible model of the family is more than TOO_SMALL x the optimum for the budget."""

    def __init__(self, smallest: ModelConfig, smallest_params: int) -> None:
        super().__init__(smallest_params)
        self.smallest, self.smallest_params = smallest, smallest_params


def seq_len_for(family: str, batch_tokens: float, num_gpus: int) -> int:
    seq_len = FAMILY_SEQ_LEN[family]
    while seq_len > MIN_SEQ_LEN and seq_len * SEQUENCES_PER_GPU * num_gpus > batch_tokens:
        seq_len //= 2
    return seq_len


def template(family: str, vocab_size: int, seq_len: int, group: int) -> ModelConfig:
    """The family's built-in template with the dataset's vocabulary, the plan's context and `group` query heads per
    KV head (what `shape` reads the grouping from)."""
    base = FAMILY_TEMPLATES[family]
    return dataclasses.replace(base, vocab_size=vocab_size, max_position_embeddings=seq_len,
                               num_attention_heads=group, num_key_value_heads=1 if group > 1 else group)


def choose_model(family: str, vocab_size: int, seq_len: int, params: int) -> ModelConfig:
    """Of each depth's shape nearest `params` (at every grouping of GROUPS), those within LOOSE_TOLERANCE of it, the
    one that best weighs balance against the count (`_score`); the nearest count when none is that close. TooSmall
    when even the smallest shape is more than TOO_SMALL x `params`."""
    candidates = [(cfg, count) for group in GROUPS[family]
                  for cfg, count in _per_depth(template(family, vocab_size, seq_len, group), params)]
    smallest = min(candidates, key=lambda c: c[1])
    if smallest[1] > TOO_SMALL * params:
        raise TooSmall(smallest[0], smallest[1])
    close = [c for c in candidates if abs(c[1] / params - 1) <= LOOSE_TOLERANCE]
    if not close:
        return min(candidates, key=lambda c: abs(c[1] - params))[0]
    return min(close, key=lambda c: _score(c[0], c[1], params, TARGET_ASPECT[family]))[0]


def _score(cfg: ModelConfig, count: int, params: int, aspect: float) -> float:
    """Lower is better: how far width / layers is from the family's aspect (too wide, i.e. too shallow, counts
    double: a few wide blocks waste the depth a transformer learns with), plus COUNT_WEIGHT x how far the count is
    from the optimum (10% off weighs as an aspect 1.3 times off), less a little for each halving of the KV heads."""
    off = math.log(cfg.hidden_size / cfg.num_hidden_layers / aspect)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    return (2 * off if off > 0 else -off) + COUNT_WEIGHT * abs(math.log(count / params)) - 0.1 * math.log2(group)


def smallest_params(family: str, vocab_size: int, seq_len: int) -> int:
    """The parameters of the smallest shape nanopt plans for this family and vocabulary: MIN_LAYERS blocks of the
    narrowest width."""
    return min(count_params(shape(base, MIN_LAYERS, widths(base)[0])).total
               for base in (template(family, vocab_size, seq_len, group) for group in GROUPS[family]))


def _per_depth(base: ModelConfig, params: int) -> list[tuple[ModelConfig, int]]:
    """For each depth from MIN_LAYERS, the width whose count is nearest `params` (counts grow with the width, so a
    bisection finds it); depths stop once even the narrowest is past twice the target."""
    grid = widths(base)
    found = []
    for layers in range(MIN_LAYERS, MAX_LAYERS + 1):
        found.append(closest_width(base, layers, params, grid))
        if count_params(shape(base, layers, grid[0])).total > 2 * params and len(found) > 1:
            break
    return found
