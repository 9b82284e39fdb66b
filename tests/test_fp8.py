"""train.json "fp8": the output head's GEMMs in FP8 inside the chunked loss (its exact CPU emulation against bf16
and fp32), which block layers torchao converts for every preset, checkpoints that resume with FP8 on or off, and
the one-line refusals where FP8 cannot run. The real torch._scaled_mm path runs only on a GPU with FP8."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from clihelp import REPO, assert_user_error, run_cli
from trainhelp import HIDE_CUDA, make_run

from nanopt.config import ModelConfig, RunConfig, TrainConfig, load_run
from nanopt.errors import ConfigError
from nanopt.model.fp8 import FORWARD_DTYPE, GRADIENT_DTYPE, scaled_matmul, to_fp8
from nanopt.model.loss import chunked_cross_entropy
from nanopt.model.transformer import Transformer
from nanopt.plan.estimate import EstimateOptions, estimate
from nanopt.plan.preflight_record import changed_setting, fingerprint
from nanopt.train.precision.fp8 import apply_fp8, check_fp8, converted_layers, fsdp_float8_all_gather

# Stated tolerances of the FP8 head against bf16 (both measured from the fp32 loss on the same problem): e4m3 keeps
# 3 mantissa bits, e5m2 2, so each FP8 element is off by up to 6% / 12%; summed over the GEMMs' inner dimension the
# errors average down to ~3% of a gradient's norm, and to ~0.05% of the loss.
LOSS_RTOL = 2e-3
GRAD_RTOL = 0.06


def head_problem(rows=512, width=128, vocab=1024, classes=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator) * 0.16
    targets = torch.randint(0, classes, (rows,), generator=generator)
    targets[:5] = -100
    return hidden, weight, targets


def loss_and_grads(hidden, weight, targets, dtype, fp8, chunk_rows=128, classes=1000):
    hidden = hidden.detach().to(dtype, copy=True).requires_grad_()
    weight = weight.detach().to(dtype, copy=True).requires_grad_()
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_rows, classes, fp8)
    loss.backward()
    return loss.detach().float(), hidden.grad.float(), weight.grad.float()


def relative_error(got, want):
    return float((got - want).norm() / want.norm())


def test_fp8_casts_to_the_top_of_the_format_with_one_scale():
    values, scale = to_fp8(torch.tensor([0.5, -1.0, 2.0]), FORWARD_DTYPE)
    assert float(scale) == 224.0  # e4m3fn's largest value, 448, over amax 2
    assert values.float().tolist() == [112.0, -224.0, 448.0]
    grads, grad_scale = to_fp8(torch.tensor([[1e-3, -4e-3]]), GRADIENT_DTYPE)
    assert float(grad_scale) == pytest.approx(57344.0 / 4e-3)
    assert grads.float().tolist() == [[14336.0, -57344.0]]  # 1e-3 x scale is exactly a quarter of e5m2's top


def test_emulated_product_is_the_dequantized_fp32_product():
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 48, generator=generator), torch.randn(48, 16, generator=generator)
    a8, a_scale = to_fp8(a, FORWARD_DTYPE)
    b8, b_scale = to_fp8(b, GRADIENT_DTYPE)
    want = (a8.float() / a_scale) @ (b8.float() / b_scale)
    torch.testing.assert_close(scaled_matmul(a8, a_scale, b8, b_scale, torch.float32, "emulate"), want)


def test_fp8_head_matches_bf16_within_the_stated_tolerance():
    problem = head_problem()
    reference = loss_and_grads(*problem, torch.float32, None)
    bf16 = loss_and_grads(*problem, torch.bfloat16, None)
    fp8 = loss_and_grads(*problem, torch.bfloat16, "emulate")
    assert abs(float(fp8[0] - bf16[0])) <= LOSS_RTOL * float(bf16[0])
    for got, want, exact in zip(fp8[1:], bf16[1:], reference[1:], strict=True):
        assert relative_error(got, want) < GRAD_RTOL
        # And FP8 really ran: its gradients are further from fp32 than bf16's rounding puts them.
        assert relative_error(got, exact) > 2 * relative_error(want, exact)


def test_fp8_head_takes_one_chunk_and_keeps_padded_rows_out():
    hidden, weight, targets = head_problem(rows=256, vocab=1024, classes=1000)
    loss, _, grad_weight = loss_and_grads(hidden, weight, targets, torch.float32, "emulate", chunk_rows=256)
    plain = loss_and_grads(hidden, weight[:1000], targets, torch.float32, None, chunk_rows=256, classes=1000)
    assert torch.all(grad_weight[1000:] == 0)  # the padded rows get no gradient, in FP8 too
    assert abs(float(loss - plain[0])) <= LOSS_RTOL * float(plain[0])


def cpu_scaled_mm() -> bool:
    """Whether this torch runs torch._scaled_mm on the CPU (newer builds do; the GPU test covers the rest)."""
    ones = torch.ones(16, 16).to(FORWARD_DTYPE)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                         out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")
def test_scaled_mm_head_equals_its_emulation_and_traces_whole():
    problem = head_problem(rows=256, width=64, vocab=512, classes=500)
    emulated = loss_and_grads(*problem, torch.bfloat16, "emulate", 128, 500)
    real = loss_and_grads(*problem, torch.bfloat16, "scaled_mm", 128, 500)
    # One graph, no break: the scales are tensors (no .item()), and the FP8 accumulation is one opaque op per chunk.
    compiled = torch.compile(chunked_cross_entropy, fullgraph=True, backend="aot_eager")
    hidden, weight = (t.bfloat16().requires_grad_() for t in problem[:2])
    compiled(hidden, weight, problem[2], 128, 500, "scaled_mm").backward()
    for got in (real[1:], (hidden.grad.float(), weight.grad.float())):
        for a, b in zip(got, emulated[1:], strict=True):
            assert relative_error(a, b) < 1e-3  # the same FP8 values; only the order of fp32 sums differs
    assert float(real[0]) == pytest.approx(float(emulated[0]), rel=1e-5)


def tiny_model(**overrides) -> ModelConfig:
    fields = {"architecture": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64, **overrides}
    return ModelConfig(**fields)


def test_model_head_in_fp8_trains_close_and_evaluates_exactly_as_bf16():
    torch.manual_seed(0)
    model = Transformer(tiny_model(tie_word_embeddings=False))
    tokens = torch.randint(0, 256, (4, 64))
    plain_loss = model(tokens, tokens)
    plain_loss.backward()
    plain_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model.head_fp8 = "emulate"
    fp8_loss = model(tokens, tokens)
    fp8_loss.backward()
    fp8_loss, plain_loss = fp8_loss.detach(), plain_loss.detach()
    assert abs(float(fp8_loss - plain_loss)) <= LOSS_RTOL * float(plain_loss)
    assert float(fp8_loss) != float(plain_loss)  # the head did run in FP8
    for name, parameter in model.named_parameters():  # the head's FP8 error reaches every layer's gradient
        assert relative_error(parameter.grad, plain_grads[name]) < GRAD_RTOL, name
    with torch.no_grad():  # evaluation: the head in the model's dtype, FP8 or not
        assert torch.equal(model(tokens, tokens), plain_loss)


# Which block layers "all" converts: dimensions multiples of 16 and past torchao's measured break-even.
EXPECTED_CONVERTED = {
    "demo": [],
    "gpt2-small": ["mlp.up_proj"],
    "gpt2-medium": ["mlp.up_proj"],
    "smollm-360m": ["mlp.gate_proj", "mlp.up_proj"],
    "llama-3.2-1b": ["attn.q_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
    "llama-1b-131k": ["attn.q_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
}


@pytest.mark.parametrize("preset", sorted(EXPECTED_CONVERTED))
def test_converted_layers_of_every_preset(preset):
    fields = {k: v for k, v in json.loads((REPO / "runs" / preset / "model.json").read_text()).items()
              if not k.startswith("_")}
    with torch.device("meta"):
        model = Transformer(ModelConfig(**fields))
    layers = model.cfg.num_hidden_layers
    expected = [f"layers.{i}.{name}" for i in range(layers) for name in EXPECTED_CONVERTED[preset]]
    assert sorted(converted_layers(model)) == sorted(expected)


def test_fsdp_float8_all_gather_only_for_even_shards():
    with torch.device("meta"):
        model = Transformer(tiny_model(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                       vocab_size=512))
    names = converted_layers(model)
    assert fsdp_float8_all_gather(model, names, 8)
    assert not fsdp_float8_all_gather(model, names, 3)  # 2048 rows do not split in 3
    assert not fsdp_float8_all_gather(model, names, 1)


def test_torchao_conversion_keeps_checkpoints_interchangeable():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    config = tiny_model(hidden_size=1024, intermediate_size=4160, num_attention_heads=8, num_hidden_layers=1)
    torch.manual_seed(0)
    plain = Transformer(config)
    converted = Transformer(config)
    names = apply_fp8(converted, "all")
    assert names == ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj"]
    assert all(isinstance(converted.get_submodule(name), Float8Linear) for name in names)
    assert converted.head_fp8 == "scaled_mm"
    state = plain.state_dict()
    assert list(converted.state_dict()) == list(state)  # same keys, same order: resume with FP8 on or off
    converted.load_state_dict(state)
    Transformer(config).load_state_dict(converted.state_dict())  # and back: plain tensors, loadable anywhere
    assert all(type(t) is torch.Tensor for t in converted.state_dict().values())
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():  # evaluation through converted layers is the plain model's
        assert torch.equal(converted(tokens, tokens), plain(tokens, tokens))


def test_fp8_all_gather_weights_reach_checkpoints_as_plain_tensors(tmp_path):
    pytest.importorskip("torchao.float8")
    from safetensors.torch import load_file, save_file

    config = tiny_model(hidden_size=1024, intermediate_size=4160, num_attention_heads=8, num_hidden_layers=1)
    torch.manual_seed(0)
    plain, converted = Transformer(config), Transformer(config)
    apply_fp8(converted, "all", fsdp_world_size=2)  # 2 ranks split every converted weight evenly: FP8 all-gather
    wrapped = converted.get_submodule("layers.0.mlp.up_proj").weight
    assert type(wrapped) is not torch.nn.Parameter and type(wrapped).__name__ == "WeightWithDynamicFloat8CastTensor"
    state = converted.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(type(t) is torch.Tensor for t in state.values())
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["layers.0.mlp.up_proj.weight"], state["layers.0.mlp.up_proj.weight"])
    converted.load_state_dict(plain.state_dict())  # a plain checkpoint resumes into the wrapped weights
    assert torch.equal(converted.state_dict()["layers.0.mlp.up_proj.weight"], plain.layers[0].mlp.up_proj.weight)


def run_config(tmp_path, fp8="head", **model) -> RunConfig:
    model_cfg = tiny_model(**model)
    train = TrainConfig(data="data", micro_batch_size=2, global_batch_tokens=128, max_steps=1, seq_len=64, fp8=fp8)
    return RunConfig(run_dir=tmp_path, model=model_cfg, train=train)


@pytest.fixture
def fake_gpu(monkeypatch):
    """What torch reports about a GPU (for the refusals' logic on a host without one); returns a setter."""
    def install(capability, name="NVIDIA H100 80GB HBM3"):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return install


def test_refusals(tmp_path, fake_gpu, monkeypatch):
    run, cuda = run_config(tmp_path), torch.device("cuda")
    check_fp8(run_config(tmp_path, fp8="off"), torch.device("cpu"), "fp32", False)  # off: nothing to check
    with pytest.raises(ConfigError, match="needs a CUDA GPU with FP8"):
        check_fp8(run, torch.device("cpu"), "fp32", False)
    fake_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability 8.9\+.*A100.* is 8.0"):
        check_fp8(run, cuda, "bf16", True)
    fake_gpu((9, 0))
    check_fp8(run, cuda, "bf16", False)  # the head needs neither torchao nor compile
    with pytest.raises(ConfigError, match="needs \"precision\": \"bf16\""):
        check_fp8(run, cuda, "fp32", True)
    with pytest.raises(ConfigError, match="multiples of 16"):
        check_fp8(run_config(tmp_path, vocab_size=250), cuda, "bf16", True)
    everything = run_config(tmp_path, fp8="all")
    with pytest.raises(ConfigError, match="needs torch.compile"):
        check_fp8(everything, cuda, "bf16", False)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    with pytest.raises(ConfigError, match="needs torchao") as refused:
        check_fp8(everything, cuda, "bf16", True)
    assert "pip install 'nanopt[fp8]'" in refused.value.hint


def test_old_torchao_or_torch_is_refused(tmp_path, fake_gpu, monkeypatch):
    torchao = pytest.importorskip("torchao")
    fake_gpu((9, 0))
    monkeypatch.setattr(torchao, "__version__", "0.9.0")
    with pytest.raises(ConfigError, match="needs torchao 0.18 or newer; this is 0.9.0"):
        check_fp8(run_config(tmp_path, fp8="all"), torch.device("cuda"), "bf16", True)
    monkeypatch.setattr(torchao, "__version__", "0.18.0")
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(ConfigError, match="needs torch 2.11 or newer for torchao's float8 training; this is 2.10.0"):
        check_fp8(run_config(tmp_path, fp8="all"), torch.device("cuda"), "bf16", True)


def test_train_on_the_cpu_with_fp8_is_one_line_and_writes_nothing(tmp_path, tiny_dataset):
    run = make_run(tmp_path, tiny_dataset, fp8="head")
    before = sorted(p.name for p in run.iterdir())
    assert_user_error(run_cli("train", run, env=HIDE_CUDA), "key 'fp8'", "needs a CUDA GPU with FP8")
    assert sorted(p.name for p in run.iterdir()) == before


def test_an_unknown_fp8_mode_is_named(tmp_path):
    shutil.copytree(REPO / "runs" / "demo", tmp_path / "run")
    with pytest.raises(ConfigError, match="'fp8'.*\"off\" / \"head\" / \"all\""):
        load_run(tmp_path / "run", {"fp8": "fast"})


def test_estimate_labels_the_bf16_peak_and_assumes_no_fp8_speedup(tmp_path):
    shutil.copytree(REPO / "runs" / "gpt2-small", tmp_path / "run")
    plain, head = load_run(tmp_path / "run"), load_run(tmp_path / "run", {"fp8": "head"})
    options = EstimateOptions(gpu="h100-sxm", num_gpus=8, mfu=0.4)
    before, after = estimate(plain, options), estimate(head, options)
    assert after["train_seconds"] == before["train_seconds"]
    assert after["gpu"]["peak_tflops"] == before["gpu"]["peak_tflops"] == 989.4
    assert 'fp8 "head": MFU against the BF16 peak' in after["gpu"]["peak_source"]
    assert "fp8" not in before["gpu"]["peak_source"]
    # A preflight measured without FP8 (or before the key existed) does not stand for an FP8 run's speed.
    older = {key: value for key, value in fingerprint(plain, 1).items() if key != "fp8"}
    assert changed_setting(older, fingerprint(plain, 1)) is None
    assert changed_setting(older, fingerprint(head, 1)) == 'fp8: "off" when measured, "head" now'


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_scaled_mm_head_matches_its_emulation_and_compiles():
    hidden, weight, targets = (t.cuda() for t in head_problem(rows=1024, width=256, vocab=2048, classes=2000))
    emulated = loss_and_grads(hidden, weight, targets, torch.bfloat16, "emulate", 256, 2000)
    real = loss_and_grads(hidden, weight, targets, torch.bfloat16, "scaled_mm", 256, 2000)
    compiled_loss = torch.compile(chunked_cross_entropy, fullgraph=True)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    compiled_loss(h, w, targets, 256, 2000, "scaled_mm").backward()
    for got in (real, (None, h.grad.float(), w.grad.float())):
        for a, b in zip(got[1:], emulated[1:], strict=True):
            assert relative_error(a, b) < 1e-2  # the same FP8 values; only the order of fp32 sums differs
    assert abs(float(real[0] - emulated[0])) < 1e-3 * float(emulated[0])


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_fp8_all_trains_close_to_bf16_on_the_gpu():
    pytest.importorskip("torchao.float8")
    config = tiny_model(hidden_size=1024, intermediate_size=4160, num_attention_heads=8, num_hidden_layers=1,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = Transformer(config).cuda()
    converted = Transformer(config).cuda()
    converted.load_state_dict(plain.state_dict())
    assert apply_fp8(converted, "all")  # eager here: the session step measures the compiled speed
    tokens = torch.randint(0, 256, (4, 256), device="cuda")
    losses = []
    for model in (plain, converted):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, tokens)
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[1] - losses[0]) <= LOSS_RTOL * losses[0]
    reference = dict(plain.named_parameters())
    for name, parameter in converted.named_parameters():
        # Every layer sees the converted layers' FP8 error in its gradient: a few times the head's alone.
        assert relative_error(parameter.grad, reference[name].grad) < 3 * GRAD_RTOL, name
