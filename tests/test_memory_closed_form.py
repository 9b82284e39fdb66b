"""The memory model's weights, gradients and optimizer state per GPU, rung by rung of the estimate's memory ladder,
against a closed-form table written here from first principles, for three model sizes on 1, 2, 4 and 8 GPUs.

With P parameters (tied embeddings counted once) and N ranks, everything fp32 (master weights, gradients, moments):
    DDP           weights 4P     gradients 4P     AdamW state 8P       (every rank holds all of it)
    ZeRO-1        weights 4P     gradients 4P     AdamW state 8P / N   (only the optimizer state is sharded)
    ZeRO-2, FSDP  weights 4P / N gradients 4P / N AdamW state 8P / N   (all sharded)
    FSDP offload  nothing on the GPU: the FSDP shards live in host memory
8-bit AdamW keeps two 1-byte moments and an fp32 scale per 256 values of each: (2 + 2 * 4 / 256) P; Muon one fp32
momentum buffer (4 bytes) for the hidden matrices M it updates and AdamW's 8 for the other P - M. Bytes that are not
whole (a shard, 8-bit state) are rounded up. One process shards nothing: on one GPU every rung is DDP's. Run health
copies the GPU's weights around a log step's update (offload: in host memory). Eager bf16 autocast on replicated
weights (DDP, ZeRO-1) keeps a 2-byte copy of every hidden matrix; ZeRO-2 keeps every block's gathered weights in the
compute dtype from forward to backward.

P, M and the blocks' parameters are counted from the model itself (built on the meta device), and P is checked
against the published sizes of GPT-2 small and Llama 3.2 1B. No training: this runs in about a second.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from nanopt.config import ModelConfig
from nanopt.config.schema import RunConfig, TrainConfig
from nanopt.model.memory import estimate_memory
from nanopt.model.transformer import Transformer
from nanopt.plan.estimate.ladder import rungs
from nanopt.plan.estimate.target import Target, run_memory

MODELS = {
    # GPT-2 small: 124,439,808 parameters (Radford et al. 2019, the released checkpoint), output head tied.
    "gpt2-small": (dict(architecture="gpt2", vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=1024), 124_439_808),
    # Llama 3.2 1B: 1,235,814,400 parameters (Meta's model card), tied embeddings, grouped-query attention.
    "llama-3.2-1b": (dict(architecture="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                          max_position_embeddings=512), 1_235_814_400),
    # An odd parameter count, so that 4P / N and the 8-bit state are not whole bytes: shards are rounded.
    "odd-gpt2": (dict(architecture="gpt2", vocab_size=509, hidden_size=35, num_hidden_layers=3,
                      num_attention_heads=5, max_position_embeddings=16, intermediate_size=99), None),
}
WORLDS = [1, 2, 4, 8]
ADAM_8BIT = Fraction(2) + Fraction(2 * 4, 256)
H100 = Target("h100", "NVIDIA H100", 989e12, "dense table peak", 80 << 30, None)


def counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(P, hidden matrices M, parameters inside the blocks), from the module's own parameters."""
    with torch.device("meta"):
        model = Transformer(cfg)
    named = list(model.named_parameters())  # a tied head is its embedding: once
    total = sum(p.numel() for _, p in named)
    hidden = sum(p.numel() for name, p in named if name.startswith("layers.") and p.dim() == 2)
    blocks = sum(p.numel() for name, p in named if name.startswith("layers."))
    return total, hidden, blocks


def by_hand(cfg: ModelConfig) -> int:
    """P from the architecture: embeddings (tied head), per-block attention, MLP and norms, the final norm."""
    h, layers, inner, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    if cfg.architecture == "llama":  # no biases; RMSNorm gains; SwiGLU's gate, up and down
        kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
        block = (2 * h * h + 2 * h * kv) + 3 * h * inner + 2 * h
        return vocab * h + layers * block + h
    # GPT-2: learned positions; q, k, v, o and the MLP's two projections with biases; LayerNorm weight and bias
    block = (4 * h * h + 4 * h) + (2 * h * inner + inner + h) + 2 * 2 * h
    return vocab * h + cfg.max_position_embeddings * h + layers * block + 2 * h


def up(amount: Fraction | int, shards: int) -> int:
    return math.ceil(Fraction(amount) / shards)


def table(params: int, hidden: int, world: int, parallelism: str, optimizer: str,
          health: bool = False) -> dict[str, int]:
    """Per-GPU bytes of weights, gradients and optimizer state (and host memory) of one rung, from first
    principles (the module docstring); with run `health`, offload's host memory also holds the weights' copy."""
    shards = world if world > 1 else 1
    if world == 1:
        parallelism = "ddp"
    state = {"adamw": Fraction(8 * params), "adamw8bit": ADAM_8BIT * params,
             "muon": Fraction(8 * (params - hidden) + 4 * hidden)}[optimizer]
    if parallelism == "ddp":
        return {"weights": 4 * params, "gradients": 4 * params, "optimizer": up(state, 1), "host": 0}
    if parallelism == "zero1":
        return {"weights": 4 * params, "gradients": 4 * params, "optimizer": up(state, shards), "host": 0}
    sharded = {"weights": up(4 * params, shards), "gradients": up(4 * params, shards),
               "optimizer": up(state, shards)}
    if parallelism in ("zero2", "fsdp"):
        return {**sharded, "host": 0}
    assert parallelism == "fsdp_offload"
    copy = sharded["weights"] if health else 0
    return {"weights": 0, "gradients": 0, "optimizer": 0, "host": sum(sharded.values()) + copy}


def states(memory) -> dict[str, int]:
    return {"weights": memory.weights, "gradients": memory.gradients, "optimizer": memory.optimizer,
            "host": memory.host}


@pytest.mark.parametrize("model", list(MODELS))
def test_the_parameter_count_is_the_published_one(model: str):
    options, published = MODELS[model]
    cfg = ModelConfig(**options)
    params, _, _ = counts(cfg)
    assert by_hand(cfg) == params
    if published is not None:
        assert params == published


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_rung_of_the_ladder_holds_the_closed_form_states_per_gpu(model: str, world: int):
    cfg = ModelConfig(**MODELS[model][0])
    params, hidden, _ = counts(cfg)
    seen = set()
    for optimizer in ("adamw", "muon"):  # an AdamW run's ladder also offers 8-bit AdamW
        train = TrainConfig(data="d", micro_batch_size=1, global_batch_tokens=8 * 16 * world, seq_len=16,
                            optimizer=optimizer, health=True, compile=False, precision="bf16")
        run = RunConfig(run_dir=Path("run"), model=cfg, train=train)
        for rung in rungs(world, optimizer):
            memory = run_memory(run, H100, "bf16", world, activation_checkpointing=rung.checkpointing,
                                parallelism=rung.parallelism, optimizer=rung.optimizer)
            expected = table(params, hidden, world, rung.parallelism, rung.optimizer, health=True)
            assert states(memory) == expected, (rung.name, world)
            # Run health's copy of the weights is of what the GPU holds (none when they are in host memory).
            assert memory.health_snapshot == expected["weights"], rung.name
            seen.add((rung.parallelism, rung.optimizer))
    if world == 1:
        assert {parallelism for parallelism, _ in seen} == {"ddp"}
    else:  # the ladder offers every layout, and 8-bit AdamW and Muon beside AdamW
        assert {parallelism for parallelism, _ in seen} == {"ddp", "zero1", "zero2", "fsdp", "fsdp_offload"}
        assert {("zero1", "adamw8bit"), ("zero1", "muon")}.isdisjoint(seen)  # train.json refuses both
        assert {("fsdp", "adamw8bit"), ("fsdp", "muon"), ("zero1", "adamw")} <= seen


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_weight_copies_gathered_blocks_and_health_follow_the_layout(model: str, world: int):
    cfg = ModelConfig(**MODELS[model][0])
    params, hidden, blocks = counts(cfg)
    for parallelism in ("ddp", "zero1", "zero2", "fsdp", "fsdp_offload"):
        layout = parallelism if world > 1 else "ddp"
        for precision, width in (("bf16", 2), ("fp32", 4)):
            for compiled in (False, True):
                for health in (False, True):
                    memory = estimate_memory(cfg, 16, precision=precision, compiled=compiled,
                                             activation_checkpointing=False, parallelism=parallelism,
                                             world_size=world, health=health)
                    where = (parallelism, precision, compiled, health)
                    # fp32 masters whatever the compute dtype: the states do not depend on precision or compile.
                    assert states(memory) == table(params, hidden, world, parallelism, "adamw", health), where
                    copies = width * hidden if (layout in ("ddp", "zero1") and width == 2 and not compiled) else 0
                    assert memory.weight_copies == copies, where
                    assert memory.gathered == (width * blocks if layout == "zero2" else 0), where
                    assert memory.health_snapshot == (memory.weights if health else 0), where
