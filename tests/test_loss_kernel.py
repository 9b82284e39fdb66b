"""The linear cross-entropy: equal to F.cross_entropy on the full logits (value and gradients), equal compiled
and eager, one pointwise softmax-gradient pass and in-GEMM head-gradient accumulation in the traced graph, chunk
geometry, and the live memory of the eager path."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nanopt.model.loss import chunked_cross_entropy
from nanopt.model.loss_chunks import FULL_LOGITS_MAX_BYTES, MAX_CHUNK_BYTES, loss_chunk_rows

ROWS, HIDDEN, VOCAB = 150, 32, 211


def problem(seed: int = 0, rows: int = ROWS, vocab: int = VOCAB):
    torch.manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, HIDDEN)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    targets[:11] = -100  # ignored rows, across the first chunk boundary
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def reference(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100)


@pytest.mark.parametrize("chunk_rows", [7, 64, ROWS, None], ids=["ragged", "three-chunks", "one-chunk", "auto"])
def test_value_and_gradients_equal_full_cross_entropy(chunk_rows):
    hidden, weight, targets = problem()
    expected = loss_and_grads(reference, hidden, weight, targets)
    got = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_rows), hidden, weight, targets)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def trace(chunk_rows: int):
    """Loss and gradients of the compiled loss, and the aten ops of the forward graph AOT autograd hands to a compiler
    (Inductor gets the same graph; this backend runs it as it is, as aot_eager does)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(graph_module, _inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_rows), backend=backend, fullgraph=True)
    results = loss_and_grads(fn, *problem(2))
    torch._dynamo.reset()
    return results, [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]


def test_compiled_equals_eager_with_a_pointwise_softmax_gradient_and_in_gemm_head_accumulation():
    compiled, ops = trace(chunk_rows=40)  # 4 chunks, the last ragged
    eager = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 40), *problem(2))
    for ours, theirs in zip(compiled, eager, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # A scatter into the fp32 probabilities stops Inductor from fusing exp, one-hot subtraction, masking and the
    # cast into one pass; an `mm` followed by `add` keeps every chunk's [V, C] product alive until the last add.
    assert not [op for op in ops if op.startswith("aten.scatter")], ops  # slice_scatter: d(hidden) rows
    accumulations = [op for op in ops if "accumulate_head_grad" in op or "auto_functionalized" in op]
    assert len(accumulations) == 4, ops  # one in-place accumulating GEMM per chunk, opaque to the fuser
    assert ops.count("aten.mm.default") == 2 * 4, ops  # each chunk's logits and d(hidden); none for d(weight)


def test_chunk_geometry():
    vocab = 128256
    # Small full logits: one chunk, i.e. the plain path.
    small = FULL_LOGITS_MAX_BYTES // (4 * vocab)
    assert loss_chunk_rows(small, vocab) == small
    # Llama-1B at micro-batch 8: a few chunks, each a multiple of 128 rows and within the byte cap.
    rows = 8 * 2048
    chunk = loss_chunk_rows(rows, vocab)
    assert 4 <= -(-rows // chunk) <= 8 and chunk % 128 == 0 and chunk * vocab * 4 <= MAX_CHUNK_BYTES
    # A huge micro-batch is bounded by the byte cap, not by the chunk count.
    huge = loss_chunk_rows(64 * 8192, vocab)
    assert huge * vocab * 4 <= MAX_CHUNK_BYTES and huge >= 128


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the mode that are alive at once (eager CPU: no allocator stats)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _track(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # In-place and out= results alias an input: no new memory.
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self._track(tensor)
        return out


def test_eager_forward_holds_one_chunk_of_logits_not_all():
    rows, vocab, chunk_rows = 1024, 2048, 128
    hidden, weight, targets = problem(3, rows=rows, vocab=vocab)
    with LiveBytes() as tracker:
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_rows)
    loss.backward()
    full_logits = rows * vocab * 4
    chunk_logits = chunk_rows * vocab * 4
    kept = rows * HIDDEN * 4 + vocab * HIDDEN * 4  # d(hidden) and the fp32 d(weight), held until backward
    # One chunk's fp32 logits, reused in place for the probabilities, and logsumexp's temporary of the same size;
    # plus small per-row and [V, C] terms. Not the pure pointwise form's extra [rows, V] buffers: that is for compile.
    assert tracker.peak <= kept + 2 * chunk_logits + 2 * vocab * HIDDEN * 4 + 64 * rows, (tracker.peak, full_logits)
    assert tracker.peak < full_logits / 2


def test_bf16_autocast_chunks_agree_with_the_plain_loss():
    # Under autocast the chunked path runs its GEMMs in bf16 and accumulates d(weight) in fp32 (through one bf16
    # product on the CPU); the plain path is F.cross_entropy on bf16 logits. Both are fp32 losses of bf16 math.
    hidden, weight, targets = problem(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 40), hidden, weight, targets)
        plain = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, ROWS), hidden, weight, targets)
    assert chunked[0].dtype == torch.float32 and chunked[2].dtype == torch.float32
    for ours, theirs in zip(chunked, plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-2)


def test_bf16_autocast_hands_the_fp32_head_gradient_to_the_weight_unrounded():
    # The head's d(weight) is summed over the chunks in fp32; it reaches the fp32 weight's .grad as summed, not
    # rounded to bf16 on the way (an autograd cast of the weight outside the loss would round it: every element
    # would then be a bf16 value).
    hidden, weight, targets = problem(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, _, grad_weight = loss_and_grads(lambda h, w, t: chunked_cross_entropy(h, w, t, 40), hidden, weight,
                                           targets)
    assert grad_weight.dtype == torch.float32
    rounded = grad_weight.bfloat16().float() != grad_weight
    assert rounded.float().mean() > 0.5, "the head's fp32 weight gradient was rounded to bf16"


def test_backward_scales_the_stored_gradients_in_place_and_only_once():
    # Backward of the chunked loss only scales d(hidden) and d(weight), which forward stored: in place, so the
    # loss's backward allocates no second [V, C] fp32 head gradient (1 GiB for a 1B Llama) on top of the first.
    rows, vocab = 512, 1024
    hidden, weight, targets = problem(5, rows=rows, vocab=vocab)
    loss = chunked_cross_entropy(hidden, weight, targets, 128)
    with LiveBytes() as tracker:
        loss.backward()
    assert tracker.peak < vocab * HIDDEN * 4 / 2, tracker.peak
    retained = chunked_cross_entropy(hidden, weight, targets, 128)
    retained.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):  # the stored gradients are spent: never scaled twice
        retained.backward()
