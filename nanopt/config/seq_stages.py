"""Sequence-length stages: train at one seq_len, then at another from a point of the run on.

    "seq_len": 2048,
    "seq_len_stages": [{"from": 0.9, "seq_len": 4096}]      seq 2048 for 90% of the tokens, then 4096

A stage's `from` is a fraction of the run in (0, 1) (of its steps, which is of its tokens: every step trains
global_batch_tokens), rounded to the nearest step as data_phases' is, or a step number >= 1. Stage 0 is train.json's
seq_len (the base) from step 0. A micro-batch keeps its tokens: a stage of length L runs micro_batch_size x base / L
sequences per micro-batch, so gradient accumulation, the tokens of every step, the learning-rate schedule (by
step) and the memory of a micro-batch's weights-and-activations stay as they were; only the attention's share
changes. A stage whose length does not divide micro_batch_size x base into whole sequences is refused, as is one
longer than the model's max_position_embeddings: that is the model's context (its learned position table for
gpt2, the context export writes), so a stage past it would train positions the model says it does not have.

Everything here is a pure function of train.json and model.json, never of the world size: the loader
(nanopt.data.loaders.staged_loader) reads stage i's windows of its length from their own shuffled order, starting where
the tokens trained before the stage put it, so a run resumes exactly on any number of ranks across a boundary.
Evaluation stays at the base seq_len, so every validation loss of the run is comparable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanopt.errors import ConfigError
from nanopt.parsing import show_value

EXAMPLE = "e.g. \"seq_len_stages\": [{\"from\": 0.9, \"seq_len\": 4096}]"


@dataclass(frozen=True)
class SeqStage:
    """From optimizer step `first_step` (0-based) on, micro-batches of `micro_batch_size` sequences of `seq_len`."""

    first_step: int
    seq_len: int
    micro_batch_size: int


def resolve_stages(raw: Any, base_seq_len: int, micro_batch_size: int, total_steps: int, max_positions: int,
                   source: str) -> tuple[SeqStage, ...]:
    """The run's stages, the base first; ConfigError (one line, naming the key) for any mistake."""
    stages = [SeqStage(0, base_seq_len, micro_batch_size)]
    if raw is None:
        return tuple(stages)
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: key 'seq_len_stages': {show_value(raw)} is not a non-empty list of stages",
                          EXAMPLE)
    tokens = micro_batch_size * base_seq_len
    for index, stage in enumerate(raw):
        where = f"{source}: key 'seq_len_stages[{index}]'"
        if not isinstance(stage, dict) or set(stage) != {"from", "seq_len"}:
            raise ConfigError(f"{where}: a stage is an object with exactly 'from' and 'seq_len'", EXAMPLE)
        first = _first_step(stage["from"], total_steps, where)
        length = _length(stage["seq_len"], tokens, micro_batch_size, base_seq_len, max_positions, where)
        if first <= stages[-1].first_step:
            raise ConfigError(f"{where}: it starts at step {first}, not after the stage before it (step "
                              f"{stages[-1].first_step})", "list the stages in the order they start")
        if length == stages[-1].seq_len:
            raise ConfigError(f"{where}: seq_len {length} is the stage before it's", "give each stage a new length")
        stages.append(SeqStage(first, length, tokens // length))
    return tuple(stages)


def _first_step(start: Any, total_steps: int, where: str) -> int:
    if isinstance(start, float) and 0 < start < 1:
        step = int(round(start * total_steps))
    elif isinstance(start, int) and not isinstance(start, bool) and start >= 1:
        step = start
    else:
        raise ConfigError(f"{where}: 'from' {show_value(start)} is neither a fraction of the run in (0, 1) nor a "
                          "step >= 1", EXAMPLE)
    if not 0 < step < total_steps:
        placed = "" if step == start else f" (step {step})"
        raise ConfigError(f"{where}: 'from' {show_value(start)}{placed} is outside the run's steps 1 to "
                          f"{total_steps - 1}", "a stage must start after step 0 and before the last step")
    return step


def _length(length: Any, tokens: int, micro: int, base: int, max_positions: int, where: str) -> int:
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ConfigError(f"{where}: 'seq_len' {show_value(length)} is not a positive integer", EXAMPLE)
    if length > max_positions:
        raise ConfigError(f"{where}: seq_len {length} exceeds the model's max_position_embeddings {max_positions}",
                          "raise max_position_embeddings in model.json to the longest stage (it is the model's "
                          "context), or shorten the stage")
    if tokens % length:
        fits = [n for n in (base * 2, base * 4, base // 2, base // 4) if n >= 1 and tokens % n == 0]
        raise ConfigError(f"{where}: seq_len {length} does not cut a micro-batch of micro_batch_size x seq_len = "
                          f"{micro} x {base} = {tokens} tokens into whole sequences (a stage keeps a micro-batch's "
                          "tokens)", f"use a length that divides {tokens}" +
                          (f", e.g. {fits[0]}" if fits else ", or raise micro_batch_size"))
    return length


def stage_at(stages: tuple[SeqStage, ...], step: int) -> SeqStage:
    """The stage optimizer step `step` (0-based) trains in."""
    return [stage for stage in stages if stage.first_step <= step][-1]


def longest(stages: tuple[SeqStage, ...]) -> SeqStage:
    """The stage of the longest sequences: the largest attention, so the peak memory and the slowest step."""
    return max(stages, key=lambda stage: stage.seq_len)


def stage_tokens(stages: tuple[SeqStage, ...], total_steps: int, batch_tokens: int) -> list[int]:
    """The tokens each stage trains in a run of `total_steps` steps of `batch_tokens`."""
    ends = [stage.first_step for stage in stages[1:]] + [total_steps]
    return [(end - stage.first_step) * batch_tokens for stage, end in zip(stages, ends, strict=True)]


def whole_in_every_stage(micro_batch_size: int, base_seq_len: int, lengths: list[int]) -> bool:
    """Whether a micro-batch of `micro_batch_size` base sequences is whole sequences in every stage's length."""
    return all(micro_batch_size * base_seq_len % length == 0 for length in lengths)


def check_alone(raw: Any, batch_warmup: bool, mixture: bool, source: str) -> None:
    """Stages change the sequences a step reads; batch warmup and a mixture each place samples by their own rule,
    which stages do not (yet) follow."""
    if raw is None:
        return
    if batch_warmup:
        raise ConfigError(f"{source}: key 'seq_len_stages': sequence-length stages do not work with batch warmup",
                          "remove the batch_warmup keys or the seq_len_stages key")
    if mixture:
        raise ConfigError(f"{source}: key 'seq_len_stages': sequence-length stages do not work with a data mixture",
                          "train on one dataset, or remove seq_len_stages")
