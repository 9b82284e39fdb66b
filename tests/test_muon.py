"""`"optimizer": "muon"`: Muon on the hidden matrices, AdamW on the rest; trains, resumes bit-exactly, agrees over
2 DDP or FSDP2 ranks (FSDP: each whole matrix orthogonalized, the state sharded, saved and restored through
torch.distributed.checkpoint's state-dict functions), is counted by the memory model, and bad values are one-line
errors."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from distributed import run_ranks
from faulthelp import tiny_run, tree_digest
from torch.distributed.tensor import Shard
from trainhelp import HIDE_CUDA, final_weights_hash, losses

from nanopt.config import load_run
from nanopt.errors import ConfigError
from nanopt.model.transformer import Transformer
from nanopt.train.optim.optimizer import build_optimizer, set_lr

MUON = {"optimizer": "muon", "muon_learning_rate": 0.02, "learning_rate": 3e-3}


def _hidden_matrices(model: torch.nn.Module) -> set[str]:
    """The oracle: every 2-D weight inside a transformer block (attention and MLP projections)."""
    return {name for name, p in model.named_parameters() if name.startswith("layers.") and p.dim() == 2}


def _names(model: torch.nn.Module, optimizer) -> dict[str, set[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {kind: {by_id[id(p)] for group in opt.param_groups for p in group["params"]}
            for kind, opt in (("muon", optimizer.muon), ("adamw", optimizer.adamw))}


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_hidden_matrices_go_to_muon_everything_else_to_adamw(tmp_path: Path, tiny_dataset: Path, architecture: str):
    run = load_run(tiny_run(tmp_path, tiny_dataset, "run", **MUON))
    model_cfg = {**run.model.to_dict(), "architecture": architecture, "tie_word_embeddings": False,
                 "attention_bias": architecture == "gpt2", "mlp_bias": architecture == "gpt2"}
    model = Transformer(type(run.model)(**model_cfg))
    optimizer = build_optimizer(model, run.train, torch.device("cpu"))
    names = _names(model, optimizer)
    assert names["muon"] == _hidden_matrices(model) and names["muon"]
    assert names["adamw"] == {name for name, _ in model.named_parameters()} - names["muon"]
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= names["adamw"]

    # The schedule sets the AdamW LR; Muon's keeps its own base LR scaled by the same factor.
    set_lr(optimizer, run.train.learning_rate * 0.25)
    assert all(g["lr"] == pytest.approx(0.02 * 0.25) for g in optimizer.muon.param_groups)
    assert all(g["lr"] == pytest.approx(3e-3 * 0.25) for g in optimizer.adamw.param_groups)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)  # what metrics.jsonl logs as "lr"


def test_muon_trains_and_a_resume_is_bit_exact(tmp_path: Path, tiny_dataset: Path, launcher):
    straight = tiny_run(tmp_path, tiny_dataset, "straight", **MUON, max_steps=20, checkpoint_interval=10,
                        eval_interval=0)
    launcher.train(straight)
    loss = losses(straight)
    assert sum(list(loss.values())[-3:]) / 3 < loss[1] - 0.2, loss  # it learns

    resumed = tiny_run(tmp_path, tiny_dataset, "resumed", **MUON, max_steps=20, checkpoint_interval=10,
                       eval_interval=0)
    (resumed / "checkpoints").mkdir()
    shutil.copytree(straight / "checkpoints" / "step-000010", resumed / "checkpoints" / "step-000010")
    child = launcher.train(resumed)
    assert "resumed from" in child.stderr, child.stderr[-2000:]
    assert final_weights_hash(resumed) == final_weights_hash(straight)


def train_in_rank(run: Path, overrides: dict) -> dict:
    """What `nanopt train RUN --set ... --allow-changed` does in each torchrun worker: the run's summary."""
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run, overrides), TrainOptions(allow_changed=True))


# A constant LR after warmup: a run stopped at step 3 and extended to 6 follows the 6-step run's schedule.
SHORT = {**MUON, "max_steps": 6, "lr_schedule": "constant", "warmup_steps": 2, "checkpoint_interval": 0,
         "eval_interval": 0}


def test_two_ddp_or_fsdp_ranks_train_like_one_process_and_fsdp_resumes(tmp_path: Path, tiny_dataset: Path, launcher):
    # 2 ranks x accumulation 1 see the same samples as 1 rank x accumulation 2: the same losses, to rounding.
    one = tiny_run(tmp_path, tiny_dataset, "one", **SHORT)
    launcher.train(one)
    expected = losses(one)
    assert len(expected) == 6
    for parallelism in ("ddp", "fsdp"):
        two = tiny_run(tmp_path, tiny_dataset, parallelism, **SHORT, parallelism=parallelism)
        # FSDP: stopped after step 3 (a session's last step checkpoints), then resumed to 6.
        sessions = [run_ranks(train_in_rank, two, {"max_steps": 3}, env=HIDE_CUDA)[0]] if parallelism == "fsdp" else []
        sessions.append(run_ranks(train_in_rank, two, {}, env=HIDE_CUDA)[0])
        assert [s["steps"] for s in sessions] == ([3, 6] if parallelism == "fsdp" else [6])
        assert sum(s["tokens_this_session"] for s in sessions) == sessions[-1]["tokens"]  # no step trained twice
        got = losses(two)
        assert got.keys() == expected.keys(), (parallelism, got)
        assert all(abs(expected[s] - got[s]) < 1e-4 for s in got), (parallelism, expected, got)


def muon_state_round_trip_in_rank(run_dir: Path) -> dict:
    """On each of 2 gloo ranks: an FSDP2-sharded model and an unsharded copy (same seed) take the same Muon steps on
    the same batch; then the sharded optimizer's state goes through get_optimizer_state_dict into a fresh sharded
    model and optimizer, and both take one more step. Returns what the test checks, as plain values."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from nanopt.runtime import init_runtime
    from nanopt.train.optim.optimizer import optimizers_of
    from nanopt.train.parallel.wrap import prepare

    run = load_run(run_dir)
    rt = init_runtime("fp32")

    def built(sharded: bool):
        torch.manual_seed(0)
        model = Transformer(run.model)
        if sharded:
            model = prepare(model, rt, run.train).raw
        return model, build_optimizer(model, run.train, rt.device)

    batch = torch.randint(0, run.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def step(model, optimizer) -> None:  # the same batch on every rank: FSDP's averaged gradient is the whole one
        model(batch[:, :-1], batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    def full(model) -> dict[str, torch.Tensor]:
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in model.named_parameters()}

    def largest_difference(a: dict, b: dict) -> float:
        return max((a[k] - b[k]).abs().max().item() for k in a)

    sharded, sharded_opt = built(True)
    plain, plain_opt = built(False)
    for _ in range(2):
        step(sharded, sharded_opt)
        step(plain, plain_opt)
    after_two = largest_difference(full(sharded), full(plain))

    state = get_optimizer_state_dict(sharded, optimizers_of(sharded_opt))["state"]
    buffers = {name: value["momentum_buffer"] for name, value in state.items() if "momentum_buffer" in value}
    placements = {name: b.placements if isinstance(b, DTensor) else None for name, b in buffers.items()}
    local_rows = {name: b.to_local().shape[0] for name, b in buffers.items() if isinstance(b, DTensor)}

    # Copies, as a checkpoint holds: the state dicts share tensors with the optimizer they come from.
    restored, restored_opt = built(True)
    set_model_state_dict(restored, copy.deepcopy(get_model_state_dict(sharded)))
    set_optimizer_state_dict(restored, optimizers_of(restored_opt),
                             copy.deepcopy(get_optimizer_state_dict(sharded, optimizers_of(sharded_opt))))
    for model, optimizer in ((sharded, sharded_opt), (restored, restored_opt), (plain, plain_opt)):
        step(model, optimizer)
    result = {"after_two": after_two, "after_three": largest_difference(full(sharded), full(plain)),
              "restored_vs_continued": largest_difference(full(restored), full(sharded)),
              "placements": placements, "local_rows": local_rows}
    dist.barrier()
    return result


def test_fsdp_muon_orthogonalizes_whole_matrices_and_its_state_dict_round_trips(tmp_path: Path, tiny_dataset: Path):
    # 33 MLP rows over 2 ranks: shards of 17 and 16 rows; the lone down projection pads its batch of 2 matrices.
    run = tiny_run(tmp_path, tiny_dataset, "run", **MUON, parallelism="fsdp", precision="fp32")
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "intermediate_size": 33}))
    rank0, rank1 = run_ranks(muon_state_round_trip_in_rank, run, env=HIDE_CUDA)
    matrices = _hidden_matrices(Transformer(load_run(run).model))
    for result in (rank0, rank1):
        # One process's maths on each whole matrix; only fp32 rounding of the weights' update may differ.
        assert result["after_two"] < 1e-6 and result["after_three"] < 1e-6, result
        assert result["restored_vs_continued"] == 0.0, result
        assert set(result["placements"]) == matrices  # a momentum buffer for every Muon matrix, and no other
        assert all(p == (Shard(0),) for p in result["placements"].values()), result["placements"]
    gate = next(name for name in matrices if name.endswith("gate_proj.weight"))
    assert (rank0["local_rows"][gate], rank1["local_rows"][gate]) == (17, 16)


@pytest.mark.parametrize(("values", "fragments"), [
    ({"optimizer": "sgd"}, ("optimizer", "'sgd'", "muon")),
    ({"optimizer": "muon", "muon_learning_rate": 0}, ("muon_learning_rate",)),
    ({"optimizer": "muon", "muon_learning_rate": -0.02}, ("muon_learning_rate",)),
])
def test_bad_values_are_one_line_errors_and_write_nothing(tmp_path: Path, tiny_dataset: Path, cli_in_process,
                                                          values: dict, fragments: tuple):
    run = tiny_run(tmp_path, tiny_dataset, "run", **values)
    before = tree_digest(run)
    assert_user_error(cli_in_process("train", run, "--no-live"), *fragments)
    assert tree_digest(run) == before


def test_a_torch_without_muon_is_one_clear_error(tmp_path: Path, tiny_dataset: Path, monkeypatch):
    run = load_run(tiny_run(tmp_path, tiny_dataset, "run", **MUON))
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ConfigError, match="torch.optim.Muon") as raised:
        build_optimizer(Transformer(run.model), run.train, torch.device("cpu"))
    assert raised.value.hint


@pytest.mark.parametrize("batch_elements", [1 << 26, 1])  # every matrix of a shape at once; one at a time
def test_the_step_batched_by_shape_is_torchs_step(tmp_path: Path, tiny_dataset: Path, monkeypatch,
                                                  batch_elements: int):
    # nanopt steps whole Muon matrices in batches of one shape (nanopt.train.optim.muon_step), a tenth of torch's kernel
    # launches. It must be torch's step: the same weights and momentum after every step, wide and tall matrices
    # (Llama's gate and down projections), whatever the batches.
    from nanopt.train.optim import muon_step

    monkeypatch.setattr(muon_step, "BATCH_ELEMENTS", batch_elements)
    run = load_run(tiny_run(tmp_path, tiny_dataset, "run", **MUON))
    ours_model = Transformer(run.model)
    torchs_model = copy.deepcopy(ours_model)
    ours = build_optimizer(ours_model, run.train, torch.device("cpu"))
    torchs = build_optimizer(torchs_model, run.train, torch.device("cpu"))
    assert ours.batched
    torchs.batched = False  # torch.optim.Muon's own step
    shapes = {tuple(p.shape) for group in ours.muon.param_groups for p in group["params"]}
    assert any(rows > cols for rows, cols in shapes) and any(rows < cols for rows, cols in shapes)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(ours_model.parameters(), torchs_model.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        ours.step()
        torchs.step()
        for (name, a), b in zip(ours_model.named_parameters(), torchs_model.parameters(), strict=True):
            assert torch.equal(a, b), name
    assert str(ours.state_dict()) == str(torchs.state_dict())  # the same momentum buffers, the same layout


def test_a_torch_whose_newton_schulz_nanopt_cannot_call_is_refused_before_training(monkeypatch):
    # FSDP's Muon calls torch's private Newton-Schulz function with the group's settings of the same names; a torch
    # whose function wants a setting Muon does not have is one clear error when the optimizer is built.
    import torch.optim._muon as torch_muon

    from nanopt.train.optim.optimizer import _torch_newton_schulz

    muon = torch.optim.Muon([torch.nn.Parameter(torch.zeros(4, 4))])
    _torch_newton_schulz(muon)  # this torch: accepted

    def changed(grad, ns_coefficients, ns_steps, eps, new_setting):
        raise AssertionError("never called")

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", changed)
    with pytest.raises(ConfigError, match="Newton-Schulz") as raised:
        _torch_newton_schulz(muon)
    assert "parallelism" in raised.value.hint


def test_estimate_counts_one_momentum_buffer_for_the_muon_matrices(tmp_path: Path, tiny_dataset: Path,
                                                                  cli_in_process):
    reports = {}
    for optimizer in ("adamw", "muon"):
        run = tiny_run(tmp_path, tiny_dataset, optimizer, optimizer=optimizer)
        result = cli_in_process("estimate", run, "--gpu", "h100-sxm", "--num-gpus", "1", "--json")
        assert result.returncode == 0, result.stderr
        reports[optimizer] = json.loads(result.stdout)["memory_bytes"]["optimizer"]
    model = Transformer(load_run(tmp_path / "muon").model)
    matrices = sum(p.numel() for name, p in model.named_parameters() if name in _hidden_matrices(model))
    total = sum(p.numel() for p in model.parameters())
    assert reports["adamw"] == 8 * total
    assert reports["muon"] == 8 * total - 4 * matrices  # AdamW's two moments become Muon's one buffer
    assert not math.isclose(reports["muon"], reports["adamw"])


def test_optimizer_cannot_change_on_resume(tmp_path: Path, tiny_dataset: Path, launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, checkpoint_interval=2, eval_interval=0)
    launcher.train(run)
    train = json.loads((run / "train.json").read_text())
    (run / "train.json").write_text(json.dumps({**train, "optimizer": "muon", "max_steps": 4}))
    child = launcher.run("train", run, "--no-live", "--allow-changed")
    assert child.status == 2, child.stderr[-2000:]
    assert "cannot resume" in child.stderr and "train.optimizer: 'adamw' -> 'muon'" in child.stderr, child.stderr

