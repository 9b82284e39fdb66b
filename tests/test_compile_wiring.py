"""How training compiles the model: static shapes; under FSDP2 each block compiled before it is sharded (a whole-model
compile over FSDP2 makes Dynamo skip the model's frame, silently); DDP buckets that hold a layer's gradients; the
profile's compile report counting skipped frames as graph breaks; and the training step's model and loss in one
graph under bf16 autocast, so a new graph break fails here instead of costing a GPU run its speed.

Dynamo runs for real here; only the backend is aot_eager instead of inductor (which traces the same graphs,
forward and backward, without minutes of C++ compilation on a 2-core CPU): where the graphs break and which frames
are skipped does not depend on the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from distributed import keep_until_exit, run_ranks
from faulthelp import TINY_MODEL, tiny_run
from trainhelp import HIDE_CUDA

from nanopt.config import load_run
from nanopt.model.transformer import Transformer


def _aot_eager_compile() -> None:
    """Every torch.compile in this process uses the aot_eager backend (see the module docstring)."""
    compile_ = torch.compile
    if not isinstance(compile_, functools.partial):
        torch.compile = functools.partial(compile_, backend="aot_eager")


WIDE_LAYER = {"hidden_size": 256, "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 8,
              "num_hidden_layers": 1}  # 28 MiB of fp32 gradients in its one layer: more than DDP's 25 MiB buckets


def _run(tmp_path: Path, tiny_dataset: Path, model: dict | None = None, **train) -> Path:
    run = tiny_run(tmp_path, tiny_dataset, "run", compile=True, **train)
    config = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**config, "num_hidden_layers": 2, **(model or {})}))
    return run


def compiled_step_in_rank(run_dir: Path) -> dict:
    """One forward and backward of the prepared model; what Dynamo counted, the parameter names, DDP's buckets."""
    from torch._dynamo.utils import counters

    from nanopt.runtime import init_runtime
    from nanopt.train.parallel.wrap import prepare

    _aot_eager_compile()
    run = load_run(run_dir)
    rt = init_runtime("fp32")
    counters.clear()
    torch.manual_seed(0)
    prepared = prepare(Transformer(run.model), rt, run.train)
    ids = torch.randint(0, run.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rt.rank))
    loss = prepared.model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    torch.distributed.barrier()
    keep_until_exit(prepared)  # a DDP wrapper
    layer_bytes = sum(p.numel() * p.element_size() for p in prepared.raw.layers[0].parameters())
    return {"frames": dict(counters["frames"]), "graphs": counters["stats"]["unique_graphs"],
            "names": [name for name, _ in prepared.raw.named_parameters()], "layer_bytes": layer_bytes,
            "bucket_bytes_cap": getattr(prepared.ddp, "bucket_bytes_cap", None), "loss": loss.item()}


@pytest.mark.parametrize(("parallelism", "model"), [("fsdp", None), ("ddp", WIDE_LAYER)])
def test_two_ranks_compile_the_model_and_keep_the_parameter_names(tmp_path: Path, tiny_dataset: Path,
                                                                  parallelism: str, model: dict | None):
    run = _run(tmp_path, tiny_dataset, model, parallelism=parallelism)
    names = [name for name, _ in Transformer(load_run(run).model).named_parameters()]
    for result in run_ranks(compiled_step_in_rank, run, env=HIDE_CUDA):
        assert result["names"] == names and math.isfinite(result["loss"])  # checkpoints keep their keys
        if parallelism == "fsdp":
            # No frame Dynamo gave up on: a whole-model compile over FSDP2 skips Transformer.forward (its hooks
            # break the graph inside the layer loop) and compiles only the blocks called from it, by accident.
            assert result["frames"]["total"] == result["frames"]["ok"] > 0, result["frames"]
        else:
            # The model and its loss in one graph (DDP's wrapper around it runs eagerly, as torch.compile(DDP)
            # always does), and a whole layer's gradients in one bucket.
            assert result["graphs"] == 1, result
            assert result["bucket_bytes_cap"] >= result["layer_bytes"] > 25 * 2**20, result


def test_ddp_buckets_hold_a_whole_layer_of_gradients(tiny_dataset: Path, tmp_path: Path):
    from nanopt.train.parallel.wrap import ddp_bucket_cap_mb

    run = load_run(tiny_run(tmp_path, tiny_dataset, "run"))
    assert ddp_bucket_cap_mb(Transformer(run.model)) == 25
    model = Transformer(dataclasses.replace(run.model, hidden_size=1024, intermediate_size=4096,
                                            num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=1))
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    assert layer_bytes > 25 * 2**20
    cap = ddp_bucket_cap_mb(model)
    assert layer_bytes <= cap * 2**20 < layer_bytes + 2 * 2**20


def test_shapes_are_static_each_new_shape_its_own_graph(tmp_path: Path, tiny_dataset: Path, monkeypatch):
    """dynamic=False: a new batch shape (an evaluation's smaller batch) compiles a static graph of its own instead of
    recompiling the training graph with symbolic sizes (slower kernels, and every later shape reusing them)."""
    from torch._dynamo.backends.registry import lookup_backend

    from nanopt.runtime import init_runtime
    from nanopt.train.parallel.wrap import prepare

    symbolic = []

    def backend(graph, example_inputs):  # aot_eager, noting which graphs take symbolic sizes
        symbolic.append(any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in x.shape)) for x in example_inputs))
        return lookup_backend("aot_eager")(graph, example_inputs)

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    run = load_run(_run(tmp_path, tiny_dataset, {"num_hidden_layers": 1}))
    torch._dynamo.reset()
    prepared = prepare(Transformer(run.model), init_runtime("fp32"), run.train)
    with torch.no_grad():
        for batch in (2, 3):  # 1 is special-cased by Dynamo; from 2 on a new size would turn symbolic
            ids = torch.randint(0, run.model.vocab_size, (batch, 9))
            prepared.model(ids[:, :-1], ids[:, 1:])
    assert symbolic == [False, False]


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_the_training_steps_model_and_loss_are_one_graph_under_bf16_autocast(architecture: str):
    from nanopt.config import ModelConfig

    kv_heads = {"llama": 1, "gpt2": 2}[architecture]  # grouped-query attention where the architecture has it
    cfg = ModelConfig(**{**TINY_MODEL, "architecture": architecture, "vocab_size": 64,
                         "num_key_value_heads": kv_heads})
    model = Transformer(cfg)
    model.loss_chunk_rows = 8  # several chunks, the last ragged: the loop is traced too
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(ids[:, :-1], ids[:, 1:])
        expected = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-5)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_compile_report_counts_a_skipped_frame_as_a_graph_break():
    from torch._dynamo.utils import counters

    from nanopt.plan.profile import compile_report

    @torch._dynamo.disable
    def hook(x):  # what FSDP2's hooks are to Dynamo
        return x

    def layers(x):
        for _ in range(3):
            x = hook(x) * 2  # a graph break inside a loop: Dynamo skips the whole frame
        return x

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(layers, backend="aot_eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 8.0))
    report = compile_report(True)
    assert report["skipped_frames"] >= 1
    assert report["graph_breaks"] >= report["skipped_frames"]
    assert any("skipped" in reason["reason"] for reason in report["break_reasons"]), report


def _tiny_llama(chunk_rows: int = 8) -> Transformer:
    from nanopt.config import ModelConfig

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY_MODEL, "architecture": "llama", "vocab_size": 64,
                                       "num_key_value_heads": 1}))
    model.loss_chunk_rows = chunk_rows  # the chunked loss and its custom op, as GPT-2 and Llama shapes take on a GPU
    return model


@pytest.mark.slow  # Inductor's C++ compilation: minutes on a 2-core CPU with a cold cache, ~15 s with a warm one
def test_inductor_compiles_training_in_one_graph_and_evaluation_in_one_more():
    """What a GPU run compiles, with Inductor itself (not aot_eager): bf16 autocast, cuDNN attention asked for, the
    chunked loss. Training is one graph with no break; the no-grad evaluation (validation's eval mode) adds exactly
    one, and neither compiles again when it comes back."""
    from torch._dynamo.utils import counters

    model = _tiny_llama()
    model.prefer_cudnn_attention(True)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="inductor", dynamic=False, fullgraph=True)

    def train_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(ids[:, :-1], ids[:, 1:])
        loss.backward()

    def evaluate() -> None:
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(ids[:, :-1], ids[:, 1:])
        model.train()

    train_step()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    evaluate()
    assert counters["stats"]["unique_graphs"] == 2  # one recompile: grad mode (and the eval flag)
    train_step()
    evaluate()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_hopper_branch_traces_whole(monkeypatch):
    """On an sm90 GPU attention prefers cuDNN by default: `_is_hopper`, a constant to Dynamo that takes an argument,
    decides, and the cuDNN-first SDPA context follows. Both must trace with fullgraph=True (here with the device's
    capability faked to (9, 0) by a function Dynamo cannot trace, and the CPU device routed to that check)."""
    from nanopt.model import transformer

    asked = []

    @torch._dynamo.disable  # as opaque to Dynamo as the real query of the driver: traced into, it breaks the graph
    def capability(device=None):
        asked.append(device)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(transformer, "cudnn_attention_by_default", lambda device: transformer._is_hopper(device.index))
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    expected = model(ids[:, :-1], ids[:, 1:])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert asked  # the Hopper check ran while tracing
    assert torch.allclose(loss.float(), expected, atol=5e-2) and torch.isfinite(loss)
