"""train.json "bf16_weight_copies" (nanopt.model.weight_copies, nanopt.train.precision.weight_copies): the blocks'
linear layers train from bf16 copies of their weights made once per optimizer step.

What a user relies on: the same mathematics as autocast's cast per micro-batch (on the CPU, where no GEMM writes fp32
from bf16, the very same numbers: losses, every gradient, every weight after training), the same parameters and
checkpoints (a run resumes with the setting flipped either way), evaluation unaffected by copies one update behind,
one whole compiled graph, DDP's gradient all-reduce intact, the memory model counting the copies, and a one-line
refusal where the setting cannot apply.
"""

from __future__ import annotations

import copy
import signal
from pathlib import Path

import pytest
import torch
from distributed import keep_until_exit, run_ranks
from trainhelp import assert_train_refused, eval_losses, final_weights_hash, losses, make_run

from nanopt.config import ModelConfig
from nanopt.errors import ConfigError
from nanopt.model.memory import estimate_memory, hidden_matrix_params
from nanopt.model.transformer import Transformer


def tiny(architecture: str, **overrides) -> ModelConfig:
    base = dict(architecture=architecture, vocab_size=211, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, intermediate_size=96,
                num_key_value_heads=2 if architecture == "llama" else 4)
    return ModelConfig(**{**base, **overrides})


CONFIGS = {
    "llama-gqa-tied": tiny("llama"),
    "llama-untied-biases": tiny("llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "gpt2-untied": tiny("gpt2", tie_word_embeddings=False),
}


def trained_like(cfg: ModelConfig) -> Transformer:
    """A model whose biases and norm gains are not their initial zeros and ones, so that each one's part shows."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return model


def micro_batches(cfg: ModelConfig, count: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, cfg.vocab_size, (3, 41), generator=generator) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def accumulated(model: Transformer, batches, forward=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The micro-batches' bf16-autocast losses and the gradients they accumulate into `.grad`, as a step makes them."""
    model.zero_grad(set_to_none=True)
    forward = model if forward is None else forward
    found = []
    for ids, targets in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(ids, targets)
        (loss / len(batches)).backward()
        found.append(loss.detach())
    return found, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_and_every_gradient_equal_autocasts_bit_for_bit_on_the_cpu(name: str, stacked: bool):
    cfg = CONFIGS[name]
    plain = trained_like(cfg)
    copied = copy.deepcopy(plain)
    for model in (plain, copied):
        model.stack_projections(stacked)
    copies = copied.keep_weight_copies(torch.bfloat16)
    copies.refresh()
    batches = micro_batches(cfg)
    (losses_ref, grads_ref), (found, grads) = accumulated(plain, batches), accumulated(copied, batches)
    assert all(torch.equal(a, b) for a, b in zip(found, losses_ref, strict=True))
    assert grads.keys() == grads_ref.keys()
    for key, grad in grads.items():
        assert grad.dtype == torch.float32 and torch.equal(grad, grads_ref[key]), key
    # the same parameters and state-dict keys: the copies are no part of a checkpoint
    assert list(copied.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert copies.nbytes == 2 * sum(p.numel() for n, p in copied.named_parameters()
                                    if n.startswith("layers.") and n.endswith("_proj.weight"))


def test_training_forwards_read_the_copies_and_evaluation_the_fp32_weights():
    """After an update the copies are stale until refreshed: a training forward shows it, an evaluation does not."""
    cfg = CONFIGS["llama-untied-biases"]
    model = trained_like(cfg)
    plain = copy.deepcopy(model)
    copies = model.keep_weight_copies(torch.bfloat16)
    copies.refresh()
    (ids, targets), = micro_batches(cfg, 1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)  # an update the copies have not seen
        for parameter in plain.parameters():
            parameter.mul_(1.5)

    def loss(m: Transformer, training: bool) -> torch.Tensor:
        m.train(training)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(training):
            return m(ids, targets).detach()

    assert not torch.equal(loss(model, True), loss(plain, True))  # the training forward read the stale copies
    assert torch.equal(loss(model, False), loss(plain, False))  # evaluation reads the weights themselves
    copies.refresh()
    assert torch.equal(loss(model, True), loss(plain, True))


def test_the_model_compiles_to_one_whole_graph_that_a_refresh_does_not_recompile():
    """Traced by Dynamo and AOTAutograd (the aot_eager backend runs their graph without Inductor's code generation):
    the same numbers as eager autocast over two steps, the copies refreshed in place between them."""
    from torch._dynamo.utils import counters

    cfg = CONFIGS["llama-untied-biases"]
    plain = trained_like(cfg)
    plain.stack_projections(True)
    copied = copy.deepcopy(plain)
    copies = copied.keep_weight_copies(torch.bfloat16)
    batches = micro_batches(cfg)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(copied, backend="aot_eager", fullgraph=True, dynamic=False)
    for _ in range(2):  # two steps, a refresh before each, as training does
        copies.refresh()
        losses_ref, grads_ref = accumulated(plain, batches)
        found, grads = accumulated(copied, batches, compiled)
        with torch.no_grad():
            for a, b in zip(plain.parameters(), copied.parameters(), strict=True):
                a.sub_(0.01 * a.grad)
                b.sub_(0.01 * b.grad)
        assert torch.equal(torch.stack(found), torch.stack(losses_ref))
        assert all(torch.equal(grad, grads_ref[key]) for key, grad in grads.items())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()


def _ddp_gradients_with_and_without_copies() -> dict:
    """On each rank: nanopt's DDP wrapping (nanopt.train.parallel.wrap.prepare) of a bf16 run, without copies and
    with, each over two micro-batches of this rank's own rows, the second one synchronised. Returns whether the two
    sides' gradients are equal, and a digest of them to compare across ranks."""
    import dataclasses
    import hashlib

    import torch.distributed as dist

    from nanopt.config import TrainConfig
    from nanopt.runtime import Runtime
    from nanopt.train.parallel.wrap import prepare

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = CONFIGS["gpt2-untied"]
    rt = Runtime(device=torch.device("cpu"), precision="bf16", rank=rank, local_rank=rank, world_size=2)
    batches = micro_batches(cfg, 4)[2 * rank:2 * rank + 2]
    sides = {}
    for with_copies in (False, True):
        train = dataclasses.replace(TrainConfig(data="unused", micro_batch_size=3, global_batch_tokens=3 * 40 * 4),
                                    compile=False, bf16_weight_copies=with_copies)
        prepared = prepare(trained_like(cfg), rt, train)
        assert (prepared.weight_copies is not None) == with_copies
        if prepared.weight_copies is not None:
            prepared.weight_copies.refresh()
        for micro, (ids, targets) in enumerate(batches):
            with prepared.gradient_sync(micro == 1):
                with rt.autocast():
                    loss = prepared.model(ids, targets)
                (loss / 2).backward()
        sides[with_copies] = {name: p.grad.clone() for name, p in prepared.raw.named_parameters()}
        keep_until_exit(prepared)  # a DDP wrapper
    dist.destroy_process_group()
    digest = hashlib.sha256()
    for name, grad in sides[True].items():
        digest.update(name.encode() + grad.numpy().tobytes())
    return {"equal": sides[True].keys() == sides[False].keys() and all(
        torch.equal(grad, sides[False][name]) for name, grad in sides[True].items()), "digest": digest.hexdigest()}


def test_under_ddp_the_gradients_are_all_reduced_as_without_copies():
    """DDP's hooks fire on the gradient each weight receives: with copies every rank ends with the same gradients
    (all-reduced), and they are the ones DDP gives without copies."""
    rank0, rank1 = run_ranks(_ddp_gradients_with_and_without_copies)
    assert rank0["equal"] and rank1["equal"]
    assert rank0["digest"] == rank1["digest"]


def test_nanopt_train_with_copies_gives_the_same_losses_evaluations_and_weights(tmp_path: Path, tiny_dataset: Path,
                                                                                launcher):
    settings = dict(precision="bf16", max_steps=8, eval_interval=4, checkpoint_interval=4)
    plain = make_run(tmp_path, tiny_dataset, "plain", **settings)
    copied = make_run(tmp_path, tiny_dataset, "copied", bf16_weight_copies=True, **settings)
    launcher.train(plain)
    launcher.train(copied)
    assert len(losses(plain)) == 8 and losses(copied) == losses(plain)
    assert eval_losses(copied) == eval_losses(plain)
    assert final_weights_hash(copied) == final_weights_hash(plain)


@pytest.mark.slow
@pytest.mark.parametrize("first", [True, False], ids=["copies-then-not", "not-then-copies"])
def test_a_run_killed_and_resumed_with_the_setting_flipped_trains_on_exactly(tmp_path: Path, tiny_dataset: Path,
                                                                             launcher, first: bool):
    settings = dict(precision="bf16", max_steps=6, checkpoint_interval=2, eval_interval=3)
    straight = make_run(tmp_path, tiny_dataset, "straight", **settings)
    launcher.train(straight)
    killed = make_run(tmp_path, tiny_dataset, "killed", bf16_weight_copies=first, **settings)
    child = launcher.start("train", killed, "--no-live", kill_at_step={
        "step": 4, "checkpoints": str(killed / "checkpoints"), "latest": "step-000002"})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"
    resumed = launcher.train(killed, "--set", f"bf16_weight_copies={str(not first).lower()}")
    assert "resumed from" in resumed.stderr and "step 2" in resumed.stderr
    assert [losses(straight)[s] for s in range(3, 7)] == [losses(killed)[s] for s in range(3, 7)]
    assert final_weights_hash(killed) == final_weights_hash(straight)


def test_refused_in_one_line_outside_bf16_and_under_fsdp2(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                         monkeypatch):
    from nanopt.config import load_run
    from nanopt.train.precision.weight_copies import check_bf16_weight_copies

    run = make_run(tmp_path, tiny_dataset, bf16_weight_copies=True)  # fp32, as the tests' runs are
    assert_train_refused(cli_in_process, monkeypatch, run,
                         "'bf16_weight_copies': true needs \"precision\": \"bf16\"")
    sharded = load_run(make_run(tmp_path, tiny_dataset, "sharded", bf16_weight_copies=True, parallelism="fsdp"))
    with pytest.raises(ConfigError, match="does not combine with \"parallelism\": \"fsdp\" over 2 ranks") as refused:
        check_bf16_weight_copies(sharded, "bf16", sharded=True, world_size=2)
    assert "\"parallelism\": \"ddp\"" in refused.value.hint
    check_bf16_weight_copies(sharded, "bf16", sharded=False, world_size=1)  # one process trains as DDP's


@pytest.mark.parametrize("compiled", [False, True])
def test_the_memory_model_counts_the_copies(compiled: bool):
    """The copies' bytes, as the model allocates them, are what the estimate adds for them: compiled, on top of
    nothing (autocast's casts are recomputed); eager, in place of the casts autocast would keep."""
    cfg = tiny("llama", num_key_value_heads=4)
    measured = Transformer(cfg).keep_weight_copies(torch.bfloat16).nbytes
    assert measured == 2 * hidden_matrix_params(cfg)

    def weight_copies(on: bool) -> int:
        return estimate_memory(cfg, 64, precision="bf16", compiled=compiled, activation_checkpointing=False,
                               parallelism="ddp", world_size=1, weight_copies=on).weight_copies

    assert weight_copies(True) == measured
    assert weight_copies(False) == (0 if compiled else measured)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_cuda_the_weight_gradients_come_out_of_the_gemm_in_fp32(compiled: bool):
    """On a GPU the copies' weight gradients skip autocast's rounding to bf16, so they are at least as close to the
    fp32 model's as autocast's are, and the losses agree to bf16's precision."""
    cfg = CONFIGS["llama-untied-biases"]
    reference = trained_like(cfg).cuda()
    plain, copied = copy.deepcopy(reference), copy.deepcopy(reference)
    copies = copied.keep_weight_copies(torch.bfloat16)
    copies.refresh()
    batches = [(ids.cuda(), targets.cuda()) for ids, targets in micro_batches(cfg)]

    def step(model: Transformer, autocast: bool):
        model.zero_grad(set_to_none=True)
        forward = torch.compile(model, dynamic=False) if compiled else model
        for ids, targets in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                (forward(ids, targets) / len(batches)).backward()
        return {n: p.grad.float() for n, p in model.named_parameters() if n.endswith("_proj.weight")}

    exact, rounded, copied_grads = step(reference, False), step(plain, True), step(copied, True)
    for name, grad in copied_grads.items():
        error, error_ref = (grad - exact[name]).norm(), (rounded[name] - exact[name]).norm()
        assert error <= 1.05 * error_ref + 1e-6 * exact[name].norm(), name
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_hundred_steps_on_cuda_with_copies_and_graphs_stay_within_the_bf16_tolerance(tmp_path: Path,
                                                                                      tiny_dataset: Path, launcher):
    """`nanopt train` with copies, replayed from CUDA graphs (the copies refreshed in place, outside the graph),
    against autocast's casts: bench/gpusession/training.py's tolerance for bf16 against fp32."""
    common = {"precision": "bf16", "max_steps": 100, "eval_interval": 0, "checkpoint_interval": 100,
              "log_interval": 5}
    plain = make_run(tmp_path, tiny_dataset, "plain", **common)
    copied = make_run(tmp_path, tiny_dataset, "copied", bf16_weight_copies=True, cuda_graphs=True, **common)
    launcher.train(plain, gpu=True)
    launcher.train(copied, gpu=True)
    a, b = losses(plain), losses(copied)
    assert sorted(a) == sorted(b) and len(a) == 20
    steps = sorted(a)
    assert max(abs(a[s] - b[s]) for s in steps[:10]) <= 0.05
    late = steps[-4:]
    assert abs(sum(b[s] for s in late) - sum(a[s] for s in late)) / sum(a[s] for s in late) <= 0.02
