"""train.json "cuda_graphs" (nanopt.train.parallel.graphed_step): the micro-step replayed from a CUDA graph.

On the CPU: its refusals, through `nanopt train` and the check itself. On a GPU (marked `gpu`, run by the GPU
window's gpu-tests step): a replayed step's gradients equal the same step run op by op, across steps whose
zero_grad drops the gradients, across a new micro-batch shape (captured again) and a batch of another
accumulation; and 100 steps of `nanopt train` with graphs stay within the bf16 tolerance of the run without.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from trainhelp import HIDE_CUDA, assert_train_refused, losses, make_run

from nanopt.config import ModelConfig, load_run
from nanopt.errors import ConfigError
from nanopt.model.transformer import Transformer
from nanopt.train.parallel.graphed_step import GraphedMicroStep, check_cuda_graphs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_cuda_graphs_on_the_cpu_is_a_one_line_error(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                      monkeypatch):
    for name, value in HIDE_CUDA.items():
        monkeypatch.setenv(name, value)
    if torch.cuda.is_available():
        pytest.skip("this process already sees a GPU (CUDA_VISIBLE_DEVICES is read once)")
    run = make_run(tmp_path, tiny_dataset, cuda_graphs=True)
    assert_train_refused(cli_in_process, monkeypatch, run, "'cuda_graphs': true needs a CUDA GPU")


def test_refused_with_several_ranks_and_in_fp16(tmp_path: Path, tiny_dataset: Path):
    cuda = torch.device("cuda")
    off = load_run(make_run(tmp_path, tiny_dataset, "off"))
    check_cuda_graphs(off, torch.device("cpu"), "fp32", 4)  # off: nothing to check, anywhere
    run = load_run(make_run(tmp_path, tiny_dataset, "on", cuda_graphs=True))
    check_cuda_graphs(run, cuda, "bf16", 1)
    with pytest.raises(ConfigError, match="one GPU only; this run has 2 ranks") as refused:
        check_cuda_graphs(run, cuda, "bf16", 2)
    assert "\"cuda_graphs\": false" in refused.value.hint
    with pytest.raises(ConfigError, match="does not take \"precision\": \"fp16\""):
        check_cuda_graphs(run, cuda, "fp16", 1)


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Transformer(cfg).cuda()


def _bf16() -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16)


def _batches(count: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 256, (batch, seq + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1].cuda(), t[:, 1:].cuda()) for t in tokens]


def _eager_grads(model: Transformer, batches) -> tuple[list[torch.Tensor], list[float]]:
    model.zero_grad(set_to_none=True)
    step_losses = []
    for inputs, targets in batches:
        with _bf16():
            loss = model(inputs, targets)
        (loss / len(batches)).backward()
        step_losses.append(float(loss))
    return [p.grad.clone() for p in model.parameters()], step_losses


def _graphed_grads(graphed: GraphedMicroStep, model: Transformer, batches) -> tuple[list[torch.Tensor], list[float]]:
    model.zero_grad(set_to_none=True)  # as the training step does after every optimizer step
    graphed.begin_step(len(batches))
    step_losses = [float(graphed.run(inputs, targets)) for inputs, targets in batches]
    return [p.grad.clone() for p in model.parameters()], step_losses


@pytest.mark.gpu
@needs_cuda
def test_replayed_gradients_equal_the_step_run_op_by_op():
    eager, captured = _model(), _model()
    graphed = GraphedMicroStep(captured, list(captured.parameters()), _bf16)
    shapes = [(3, 4, 32, 1), (3, 4, 32, 2), (2, 4, 32, 3), (3, 2, 64, 4)]  # accum, batch, seq, data seed
    for accum, batch, seq, seed in shapes:
        batches = _batches(accum, batch, seq, seed)
        want, want_losses = _eager_grads(eager, batches)
        got, got_losses = _graphed_grads(graphed, captured, batches)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert got_losses == want_losses
    assert graphed.captures == 2  # once, and once more for the new micro-batch shape


@pytest.mark.gpu
@needs_cuda
def test_a_parameter_moved_to_new_storage_is_captured_again():
    model = _model()
    graphed = GraphedMicroStep(model, list(model.parameters()), _bf16)
    batches = _batches(2, 4, 32, 0)
    _graphed_grads(graphed, model, batches)
    moved = model.layers[0].mlp.down_proj.weight
    moved.data = moved.data.clone()  # the same Parameter on new memory, as `.data =` or a move does
    eager = _model()
    want, _ = _eager_grads(eager, batches)
    got, _ = _graphed_grads(graphed, model, batches)
    assert graphed.captures == 2
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_a_hundred_steps_with_graphs_stay_within_the_bf16_tolerance(tmp_path: Path, tiny_dataset: Path, launcher):
    common = {"precision": "bf16", "max_steps": 100, "eval_interval": 0, "checkpoint_interval": 100,
              "log_interval": 5}
    plain = make_run(tmp_path, tiny_dataset, "plain", **common)
    graphed = make_run(tmp_path, tiny_dataset, "graphed", cuda_graphs=True, **common)
    launcher.train(plain, gpu=True)
    launcher.train(graphed, gpu=True)
    a, b = losses(plain), losses(graphed)
    assert sorted(a) == sorted(b) and len(a) == 20
    steps = sorted(a)
    assert max(abs(a[s] - b[s]) for s in steps[:10]) <= 0.05  # bench/gpusession/training.py's EARLY_ABS_TOL
    late = steps[-4:]
    assert abs(sum(b[s] for s in late) - sum(a[s] for s in late)) / sum(a[s] for s in late) <= 0.02
