"""Stacked projections (Transformer.stack_projections, nanopt.model.stacked): q/k/v, and SwiGLU's gate/up, computed as
one GEMM each over the layers' concatenated weights, with the same Parameters.

What a user relies on: the same losses and gradients as one GEMM per layer, fewer GEMMs, the same state-dict keys
(a checkpoint of either loads into the other), FSDP2 sharding and torchao's FP8 layers unchanged, a whole compiled
graph, and the memory model counting what the stacked blocks keep.

Equal to fp32 rounding, not bit for bit: the input gradient of a stacked group is one GEMM over all its output
columns where the separate layers form three (two) products and sum them, another order of fp32 additions. The
forward computes the same dot products and is bit-equal on this CPU, but a BLAS may pick another kernel for the
wider product, so the losses are held to the same rounding tolerance.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from distributed import run_ranks
from memoryhelp import saved_by_blocks
from torch.utils._python_dispatch import TorchDispatchMode

from nanopt.config import ModelConfig
from nanopt.model.memory import activation_bytes_per_token_per_layer, estimate_memory
from nanopt.model.transformer import Transformer

# Per tensor: |stacked - separate| <= RTOL |separate| + ATOL x (the largest gradient entry of the model). Seen:
# 4e-7 of a tensor's largest entry, a few fp32 ulps; the ATOL floor is for gradients that are zero up to rounding
# (the key bias's: softmax ignores a shift shared by every key), whose rounding noise has no relative scale.
RTOL, ATOL = 1e-5, 1e-6


def tiny(architecture: str, **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=211, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, intermediate_size=96,
                num_key_value_heads=2 if architecture == "llama" else 4)
    cfg = ModelConfig(**{**base, **overrides})
    cfg.validate()
    return cfg


CONFIGS = {
    "llama-gqa-tied": tiny("llama"),
    "llama-mha-untied-biases": tiny("llama", num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True,
                                    mlp_bias=True),
    "llama-qk-norm": tiny("llama", qk_norm=True),
    "gpt2-tied": tiny("gpt2"),
    "gpt2-untied": tiny("gpt2", tie_word_embeddings=False),
}


def trained_like(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose biases and norm gains are not their initial zeros and ones, so that each one's part shows."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def batch(cfg: ModelConfig, rows: int = 3, seq: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: Transformer, stacked: bool, ids: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    model.stack_projections(stacked)
    loss = model(ids, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same_to_rounding(stacked, separate) -> None:
    (loss, grads), (loss_ref, grads_ref) = stacked, separate
    torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=0)
    assert grads.keys() == grads_ref.keys()
    largest = max(g.abs().max() for g in grads_ref.values()).item()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=RTOL, atol=ATOL * largest, msg=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stacked_losses_and_every_gradient_equal_the_separate_ones(name: str):
    cfg = CONFIGS[name]
    model = trained_like(cfg)
    ids, targets = batch(cfg)
    assert_same_to_rounding(loss_and_grads(model, True, ids, targets), loss_and_grads(model, False, ids, targets))


class GemmCount(TorchDispatchMode):
    """Counts the matrix products (mm, addmm: what F.linear dispatches to) run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def gemms_of_a_step(model: Transformer, stacked: bool, ids: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(GEMMs of a training forward, of its backward)."""
    model.stack_projections(stacked)
    with GemmCount() as forward:
        loss = model(ids, targets)
    with GemmCount() as backward:
        loss.backward()
    return forward.count, backward.count


@pytest.mark.parametrize(("architecture", "fewer_per_layer"), [("llama", 3), ("gpt2", 2)])
def test_each_stacked_group_is_one_gemm_forward_and_two_backward(architecture: str, fewer_per_layer: int):
    """Llama: q, k, v and gate, up are two GEMMs where they were five; GPT-2: q, k, v one where they were three.
    In backward each group's input and weight gradients are one GEMM each."""
    cfg = tiny(architecture)
    model = trained_like(cfg)
    ids, targets = batch(cfg)
    (forward, backward), (forward_ref, backward_ref) = (gemms_of_a_step(model, s, ids, targets) for s in (True, False))
    fewer = fewer_per_layer * cfg.num_hidden_layers
    assert (forward_ref - forward, backward_ref - backward) == (fewer, 2 * fewer)


def test_layers_torchao_converted_to_fp8_keep_their_own_gemm():
    """fp8 "all" converts the layers its measurements favour (here gate and up, not the 1024-wide q, k, v): stacking
    leaves those layers to their own FP8 GEMM and stacks the rest."""
    pytest.importorskip("torchao.float8")
    from nanopt.train.precision.fp8 import apply_fp8

    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=1024, intermediate_size=4160,
                      num_hidden_layers=1, num_attention_heads=8, max_position_embeddings=64)
    torch.manual_seed(0)
    plain, converted = Transformer(cfg), Transformer(cfg)
    converted.load_state_dict(plain.state_dict())
    assert apply_fp8(converted, "all") == ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]
    converted.stack_projections(True)
    called = []
    for name in ("attn.q_proj", "mlp.gate_proj", "mlp.up_proj"):
        converted.layers[0].get_submodule(name).register_forward_hook(lambda *_, name=name: called.append(name))
    ids, targets = batch(cfg, rows=1, seq=16)
    with torch.no_grad():  # the converted layers run in plain precision without gradients (nanopt.train.precision.fp8)
        loss = converted(ids, targets)
    assert called == ["mlp.gate_proj", "mlp.up_proj"]  # q, k, v stacked; gate and up by their own forwards
    with torch.no_grad():
        torch.testing.assert_close(loss, plain(ids, targets), rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", ["llama-gqa-tied", "gpt2-untied"])
def test_a_checkpoint_of_either_path_loads_into_the_other_with_the_same_loss(name: str):
    cfg = CONFIGS[name]
    ids, targets = batch(cfg)
    for writer_stacked in (True, False):  # the other side is a model as built, never told either way
        writer = trained_like(cfg)
        if writer_stacked:
            writer.stack_projections(True)
        optimizer = torch.optim.AdamW(writer.parameters(), lr=1e-2)
        for _ in range(3):
            writer(ids, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        file = io.BytesIO()
        torch.save(writer.state_dict(), file)
        file.seek(0)
        reader = Transformer(cfg)
        if not writer_stacked:
            reader.stack_projections(True)
        assert list(reader.state_dict()) == list(writer.state_dict())
        reader.load_state_dict(torch.load(file, weights_only=True))  # strict: no key missing or unexpected
        with torch.no_grad():
            torch.testing.assert_close(reader(ids, targets), writer(ids, targets), rtol=RTOL, atol=0)


def test_the_stacked_model_compiles_to_one_whole_graph_with_the_same_loss_and_gradients():
    from torch._dynamo.utils import counters

    cfg = CONFIGS["llama-mha-untied-biases"]
    model = trained_like(cfg)
    ids, targets = batch(cfg)
    separate = loss_and_grads(model, False, ids, targets)
    model.stack_projections(True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    model.zero_grad(set_to_none=True)
    loss = compiled(ids, targets)
    loss.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert_same_to_rounding((loss.detach(), {n: p.grad for n, p in model.named_parameters()}), separate)
    torch._dynamo.reset()


def _fsdp2_gradients(name: str) -> dict[str, dict[str, Any]]:
    """On each rank: the model sharded by FSDP2 as nanopt shards it (one unit per block, then the root), one step
    with projections separate and one stacked, on this rank's own rows; the full gradients of each (as numpy arrays:
    a tensor would come back through shared memory that the rank's exit frees)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    cfg = CONFIGS[name]
    model = trained_like(cfg)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ids, targets = batch(cfg, rows=2, seed=dist.get_rank())
    grads = {}
    for stacked in (False, True):
        model.zero_grad(set_to_none=True)
        model.stack_projections(stacked)
        model(ids, targets).backward()
        grads[str(stacked)] = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return grads


def test_under_fsdp2_sharding_stacked_gradients_equal_the_separate_ones():
    rank0, rank1 = ({side: {n: torch.from_numpy(g) for n, g in grads.items()} for side, grads in rank.items()}
                    for rank in run_ranks(_fsdp2_gradients, "llama-gqa-tied"))
    for grads in (rank0, rank1):
        assert_same_to_rounding((torch.zeros(()), grads["True"]), (torch.zeros(()), grads["False"]))
    assert all(torch.equal(rank0["True"][n], rank1["True"][n]) for n in rank0["True"])  # reduced across ranks


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_the_memory_model_counts_what_stacked_blocks_keep(architecture: str):
    """The bytes the blocks save, measured from the tensors (tests/memoryhelp.py): per token, the slope between two
    batch sizes (under bf16 autocast one input cast per norm, not one per projection); per model, what stacking adds
    whatever the batch (fp32: the concatenated weights, only in blocks that are not checkpointed)."""
    cfg = ModelConfig(architecture=architecture, vocab_size=512, hidden_size=128, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2 if architecture == "llama"
                      else 4, max_position_embeddings=128)
    tokens = torch.randint(0, cfg.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))

    def measured(stacked: bool, autocast: torch.dtype | None, checkpointing: bool | int = False) -> tuple[float, float]:
        from nanopt.train.parallel.recompute import apply_activation_checkpointing

        torch.manual_seed(0)
        model = Transformer(cfg)
        model.stack_projections(stacked)
        apply_activation_checkpointing(model, checkpointing)
        four, two = (saved_by_blocks(model, rows, autocast=autocast) for rows in (tokens, tokens[:2]))
        slope = (four - two) / (2 * 128)
        return slope / cfg.num_hidden_layers, two - 2 * 128 * slope

    per_token, _ = measured(True, torch.bfloat16)
    assert per_token == activation_bytes_per_token_per_layer(cfg, 2, compiled=False, stacked=True)
    assert per_token < activation_bytes_per_token_per_layer(cfg, 2, compiled=False, stacked=False)
    for checkpointing in (False, 2):
        added = measured(True, None, checkpointing)[1] - measured(False, None, checkpointing)[1]
        predicted = [estimate_memory(cfg, 128, precision="fp32", compiled=False, cuda=False, parallelism="ddp",
                                     world_size=1, activation_checkpointing=checkpointing, stacked=s).weight_copies
                     for s in (True, False)]
        assert added == predicted[0] - predicted[1] > 0, checkpointing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_cuda_in_bf16_stacked_trains_as_separate(compiled: bool):
    """cuBLAS picks its kernels by shape (split-K for the narrow products), so the stacked GEMMs round differently
    in bf16 (2^-8 relative per element), and the differences compound through backward: the same body under CPU
    bf16 autocast differs by 0.7% of a gradient's norm at most (0.9% compiled), and 3e-5 of the loss. A wrong
    stacking (k and v swapped) moves the loss by 0.5% and some gradient by more than its own norm."""
    cfg = CONFIGS["llama-gqa-tied"]
    model = trained_like(cfg).cuda()
    ids, targets = (t.cuda() for t in batch(cfg, rows=4, seq=64))
    results = {}
    for stacked in (False, True):
        model.zero_grad(set_to_none=True)
        model.stack_projections(stacked)
        forward = torch.compile(model, dynamic=False) if compiled and stacked else model
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids, targets)
        loss.backward()
        results[stacked] = loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}
    (loss, grads), (loss_ref, grads_ref) = results[True], results[False]
    assert abs(loss - loss_ref) <= 2e-3 * loss_ref
    for name, grad in grads.items():
        assert (grad - grads_ref[name]).norm() <= 5e-2 * grads_ref[name].norm(), name
    torch._dynamo.reset()
