"""train.json "bf16_residual" (nanopt.train.precision.residual): the residual stream between blocks in bf16 under bf16
autocast. It keeps half the bytes of the stream for backward, trains within the bf16-against-fp32 tolerance of the
fp32 stream, and is refused in one line outside bf16. On the CPU's bf16 autocast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainhelp import assert_train_refused, losses, make_run

from nanopt.config import ModelConfig
from nanopt.model.transformer import Transformer

# bench/gpusession/training.py's tolerance for bf16 against fp32 (bench/RESULTS.md): early steps in nats, the mean
# of the last fifth relative.
EARLY_STEPS, EARLY_ABS_TOL, LATE_REL_TOL = 10, 0.05, 0.02


def _model(architecture: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(architecture=architecture, vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return Transformer(cfg)


def _stream_and_saved(model: Transformer) -> tuple[set[torch.dtype], int]:
    """(the dtypes entering and leaving each block, the bytes autograd saves for backward) of one bf16 step."""
    seen: set[torch.dtype] = set()
    hooks = [block.register_forward_hook(lambda _m, args, out: seen.update({args[0].dtype, out.dtype}))
             for block in model.layers]
    saved = []
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    for hook in hooks:
        hook.remove()
    return seen, sum(saved)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_the_stream_is_bf16_and_backward_keeps_fewer_bytes(architecture: str):
    plain, narrow = _model(architecture), _model(architecture)
    narrow.residual_dtype = torch.bfloat16
    plain_dtypes, plain_bytes = _stream_and_saved(plain)
    narrow_dtypes, narrow_bytes = _stream_and_saved(narrow)
    assert plain_dtypes == {torch.float32} and narrow_dtypes == {torch.bfloat16}
    assert narrow_bytes < plain_bytes
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in narrow.parameters() if p.requires_grad)


def test_training_stays_within_the_bf16_tolerance_of_the_fp32_stream(tmp_path: Path, tiny_dataset: Path, launcher):
    common = {"precision": "bf16", "max_steps": 40, "eval_interval": 0, "checkpoint_interval": 40}
    plain = make_run(tmp_path, tiny_dataset, "plain", **common)
    narrow = make_run(tmp_path, tiny_dataset, "narrow", bf16_residual=True, **common)
    launcher.train(plain)
    launcher.train(narrow)
    a, b = losses(plain), losses(narrow)
    steps = sorted(a)
    assert steps == sorted(b) and len(steps) == 40
    assert a != b  # the stream really was narrowed: the arithmetic differs
    assert max(abs(a[s] - b[s]) for s in steps[:EARLY_STEPS]) <= EARLY_ABS_TOL
    late = steps[-len(steps) // 5:]
    late_a, late_b = (sum(x[s] for s in late) / len(late) for x in (a, b))
    assert abs(late_b - late_a) / late_a <= LATE_REL_TOL


def test_refused_outside_bf16_in_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process, monkeypatch):
    run = make_run(tmp_path, tiny_dataset, bf16_residual=True)  # fp32, as the tests' runs are
    assert_train_refused(cli_in_process, monkeypatch, run, "'bf16_residual': true needs \"precision\": \"bf16\"")
