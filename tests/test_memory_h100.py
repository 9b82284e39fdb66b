"""The memory model against what an H100 measured, and its terms as golden values derived tensor by tensor.

The measurements are the first GPU window's (bench/gpusession on one H100 80GB HBM3, torch 2.11, CUDA 13,
bf16, random tokens, a step of one micro-batch, the peak reset after a warm-up step): nanopt's peak, the allocator's
peak reserved bytes plus the CUDA context. The model was derived from the tensors each op saves (nanopt.model.memory's
docstrings), not fitted to these figures; all of them are checked at once.
"""

from __future__ import annotations

import pytest
import torch
from clihelp import REPO
from memoryhelp import saved_by_blocks

from nanopt.config import ModelConfig, load_run
from nanopt.model.memory import activation_bytes_per_token_per_layer, estimate_memory
from nanopt.model.memory_loss import loss_bytes_per_token, loss_chunk_row_bytes
from nanopt.model.transformer import Transformer

GIB = 1 << 30
GPT2 = load_run(REPO / "runs" / "gpt2-small").model
LLAMA = load_run(REPO / "runs" / "llama-3.2-1b").model

# (model, seq_len, micro-batch, activation checkpointing, compiled, measured peak GiB): the records memory:gpt2-small,
# memory:llama-1b (eager), the throughput records' nanopt side (compiled) and find-batch's trial at 128 (eager).
H100 = [
    (GPT2, 1024, 32, False, False, 17.223),
    (GPT2, 1024, 32, True, False, 7.085),
    (LLAMA, 2048, 8, False, False, 53.921),
    (LLAMA, 2048, 8, True, False, 24.388),
    (GPT2, 1024, 32, False, True, 13.784),
    (LLAMA, 2048, 8, False, True, 39.62),
    (GPT2, 1024, 128, False, False, 52.753),
]


def one_micro_batch_step(cfg: ModelConfig, seq_len: int, checkpointing: bool, compiled: bool):
    return estimate_memory(cfg, seq_len, precision="bf16", compiled=compiled, activation_checkpointing=checkpointing,
                           parallelism="ddp", world_size=1, step_sequences=0)


@pytest.mark.parametrize(("cfg", "seq_len", "micro_batch", "checkpointing", "compiled", "measured_gib"), H100)
def test_predicted_peak_is_within_3_percent_of_what_an_h100_measured(cfg, seq_len, micro_batch, checkpointing,
                                                                      compiled, measured_gib):
    predicted = one_micro_batch_step(cfg, seq_len, checkpointing, compiled).total(micro_batch)
    assert predicted / (measured_gib * GIB) - 1 == pytest.approx(0, abs=0.03), predicted / GIB


def test_eager_bf16_bytes_per_token_tensor_by_tensor():
    # GPT-2 small: 8h fp32 residual + LayerNorms' mean and rstd 16 + q, k, v, fc's own bf16 casts of the fp32 norm
    # outputs 4 x 2h + q, k, v, output 8h + log-sum-exp 48 + fc and GELU outputs 2 x 2 x 3072
    assert activation_bytes_per_token_per_layer(GPT2, 2, compiled=False) == 30_784
    # Llama 1B: 8h residual + RMSNorms' fp32 normalized values and 1/rms 2 x (4h + 4) + 5 x 2h casts + q 2h, k and
    # v 2 x 1024, output 2h, log-sum-exp 128 + gate, up, silu(gate), product 4 x 2 x 8192
    assert activation_bytes_per_token_per_layer(LLAMA, 2, compiled=False) == 129_160
    # the final norm's fp32 input and output, what it saves, the loss's bf16 operand and its bf16 d(hidden)
    assert loss_bytes_per_token(GPT2, 2, compiled=False) == 9_224
    assert loss_bytes_per_token(LLAMA, 2, compiled=False) == 32_772
    # per chunk row: bf16 logits, the last chunk's bf16 gradient, fp32 logits, logsumexp's temporary, and on CUDA
    # one fp32 chunk the allocator keeps reserved
    assert loss_chunk_row_bytes(GPT2, 2, compiled=False, cuda=True) == 16 * 50_304
    assert loss_chunk_row_bytes(GPT2, 4, compiled=False, cuda=False) == 12 * 50_304


def test_eager_gpt2_small_at_32_by_1024_term_by_term():
    memory = one_micro_batch_step(GPT2, 1024, False, False)
    assert memory.activations_per_sequence == (12 * 30_784 + 9_224) * 1024
    assert memory.loss_chunk_bytes(32) == 16 * 50_304 * 4_096  # an eighth of 32,768 rows
    assert memory.loss_chunk_bytes(128) == 16 * 50_304 * 5_248  # capped: 1 GiB of fp32 logits, in 128-row tiles
    assert memory.weight_copies == 2 * 12 * (4 * 768 * 768 + 2 * 768 * 3072)  # the blocks' bf16 weights
    assert memory.loss_buffers == 6 * 50_304 * 768  # fp32 d(head) and the head's bf16 copy
    # one micro-batch per step: the gradients are freed before the forward's peak
    assert memory.total(32) == (memory.weights + memory.optimizer + memory.runtime_overhead + memory.weight_copies
                                + memory.loss_buffers + 32 * memory.activations_per_sequence
                                + memory.loss_chunk_bytes(32))


def test_a_step_that_accumulates_holds_the_gradients_at_its_peak():
    one = one_micro_batch_step(LLAMA, 2048, False, False)
    accumulating = estimate_memory(LLAMA, 2048, precision="bf16", compiled=False, activation_checkpointing=False,
                                   parallelism="ddp", world_size=1, step_sequences=32)
    assert accumulating.total(8) - one.total(8) == one.gradients == 4 * 1_235_814_400
    assert accumulating.total(32) == one.total(32)  # 32 sequences a step: one micro-batch


def test_checkpointing_peaks_in_the_loss_at_a_large_micro_batch_and_in_backward_at_a_small_one():
    memory = one_micro_batch_step(LLAMA, 2048, True, False)
    states = memory.weights + memory.gradients + memory.optimizer + memory.runtime_overhead
    # micro-batch 1: every gradient and one rebuilt block outweigh the loss's chunk and the weight copies
    assert memory.total(1) == states + memory.recompute_per_sequence
    assert memory.total(8) > states + 8 * memory.recompute_per_sequence


@pytest.mark.parametrize("architecture", ["gpt2", "llama"])
def test_eager_autocast_bytes_are_what_the_blocks_save(architecture: str):
    """Under bf16 autocast on the CPU (the same casts as on CUDA: fp32 norms, a new cast of their output at every
    matmul), the bytes saved per token and layer: the slope between two batch sizes, so the weights' bf16 copies
    (saved too, whatever the batch) drop out."""
    cfg = ModelConfig(architecture=architecture, vocab_size=512, hidden_size=128, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2 if architecture == "llama"
                      else 4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 129), generator=torch.Generator().manual_seed(0))
    four, two = (saved_by_blocks(model, batch, autocast=torch.bfloat16) for batch in (tokens, tokens[:2]))
    slope = (four - two) / (2 * 128)
    assert slope / cfg.num_hidden_layers == activation_bytes_per_token_per_layer(cfg, 2, compiled=False)


def test_find_batch_compares_the_prediction_with_the_sizes_it_can_try():
    """The H100's eager GPT-2 search (global batch 512 sequences: only powers of two divide it): 128 fit, 256 ran
    out of memory. The model's 188 (in 95% of the card) is no size the search could try; of those, it picks 128.
    Trials now step as the run will (two micro-batches where it accumulates, as at 128), so the prediction holds the
    gradients, 0.46 GiB; the H100's trial at 128 stepped one micro-batch and held none: +1.2% for that reason
    alone, against +0.3% without them."""
    from nanopt.plan.find_batch.calibration import calibrate
    from nanopt.plan.find_batch.search import Trial

    run = load_run(REPO / "runs" / "gpt2-small")
    trials = {size: Trial(micro_batch_size=size, fits=fits, reason="fits" if fits else "OOM", peak_memory_bytes=peak,
                          tokens_per_s=None, mfu=None, mfu_note=None, step_time_s=None, grad_accum=512 // size)
              for size, fits, peak in ((128, True, int(52.753 * GIB)), (256, False, None))}
    facts = {"precision": "bf16", "compiled": False, "device": "cuda"}
    calibration = calibrate(run, 1, facts, trials, int(0.95 * 85_017_493_504), 128, capped=False)
    assert calibration["predicted_max_micro_batch"] == 188
    assert calibration["predicted_usable_micro_batch"] == 128
    assert calibration["max_micro_batch_error"] == 0
    assert calibration["peak_error"] == pytest.approx(0.003 + 0.46 / 52.753, abs=0.002)
