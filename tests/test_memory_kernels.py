"""The memory model knows the attention kernel a precision and shape get on CUDA (the math fallback materializes the
[B, H, T, T] scores) and the loss's own buffers; `nanopt estimate` warns about the fallback in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from clihelp import REPO

from nanopt.config import ModelConfig
from nanopt.model.loss_chunks import LOSS_CHUNKS
from nanopt.model.memory import attention_kernel, estimate_memory

GQA = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=960, intermediate_size=2560,
                  num_hidden_layers=4, num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048)
MHA = dataclasses.replace(GQA, num_key_value_heads=15)
SEQ = 2048


def memory(cfg: ModelConfig, precision: str, cuda: bool = True):
    return estimate_memory(cfg, SEQ, precision=precision, compiled=True, activation_checkpointing=False,
                           parallelism="ddp", world_size=1, cuda=cuda)


@pytest.mark.parametrize(("cfg", "precision", "kernel"), [
    (GQA, "bf16", "flash"), (GQA, "fp32", "math"), (MHA, "fp32", "efficient"), (MHA, "bf16", "flash"),
    (dataclasses.replace(GQA, hidden_size=15 * 20), "bf16", "math"),  # head_dim not a multiple of 8
    (dataclasses.replace(GQA, hidden_size=15 * 320), "bf16", "math"),  # past flash's 256
])
def test_attention_kernel_by_precision_and_shape(cfg, precision, kernel):
    assert attention_kernel(cfg, precision) == kernel


def test_math_fallback_counts_the_scores():
    scores = GQA.num_hidden_layers * GQA.num_attention_heads * SEQ * SEQ * 4  # fp32 [H, T, T] per layer, saved
    fallback = memory(GQA, "fp32").activations_per_sequence - memory(GQA, "fp32", cuda=False).activations_per_sequence
    assert fallback >= scores
    # bf16 gets flash on CUDA: the same accounting as a kernel that never materializes the scores.
    assert memory(GQA, "bf16").activations_per_sequence == memory(GQA, "bf16", cuda=False).activations_per_sequence


def test_loss_buffers_are_counted():
    bf16 = memory(GQA, "bf16")
    head = GQA.vocab_size * GQA.hidden_size
    # fp32 d(head), formed in forward and kept until backward, and its bf16 copy for autograd there
    assert bf16.loss_buffers == (4 + 2) * head and bf16.fixed() >= bf16.loss_buffers + bf16.weights
    assert memory(GQA, "fp32").loss_buffers == 4 * head  # fp32: scaled in place, handed to autograd as it is
    # Compiled: one chunk's fp32 softmax and bf16 logits, an eighth of the micro-batch's rows (nanopt.model.loss_chunks)
    assert bf16.loss_chunk_bytes(1) == GQA.vocab_size * (4 + 2) * SEQ // LOSS_CHUNKS
    assert bf16.total(2) - bf16.total(1) == bf16.activations_per_sequence + bf16.loss_chunk_bytes(1)


def gqa_run(tmp_path: Path, precision: str) -> Path:
    run = tmp_path / f"run-{precision}"
    shutil.copytree(REPO / "runs" / "smollm-360m", run)
    train = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**train, "precision": precision}))
    return run


def test_estimate_warns_about_the_math_fallback_for_fp32_gqa(tmp_path, cli_in_process):
    fp32 = cli_in_process("estimate", gqa_run(tmp_path, "fp32"), "--gpu", "h100-sxm")
    bf16 = cli_in_process("estimate", gqa_run(tmp_path, "bf16"), "--gpu", "h100-sxm")
    assert fp32.returncode == 0 and bf16.returncode == 0, (fp32.stderr, bf16.stderr)
    warnings = [line for line in (fp32.stdout + fp32.stderr).splitlines() if "math" in line and "warning" in line]
    assert len(warnings) == 1, fp32.stdout + fp32.stderr
    assert "bf16" in warnings[0] and "precision" in warnings[0] and "grouped-query" in warnings[0]
    assert "math" not in bf16.stdout + bf16.stderr

    fp32_json = json.loads(cli_in_process("estimate", gqa_run(tmp_path / "j", "fp32"), "--gpu", "h100-sxm",
                                          "--json").stdout)
    assert fp32_json["attention"]["kernel"] == "math" and "bf16" in fp32_json["attention"]["warning"]
