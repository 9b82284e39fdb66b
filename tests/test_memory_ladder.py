"""The memory ladder's training choices (train.json's `parallelism`: zero1, zero2, fsdp_offload beside ddp and fsdp;
`activation_checkpointing`: every k-th block, selective) train the tiny Llama on 2 and 4 gloo ranks to DDP's
losses, and resume after a real kill (SIGKILL in every rank) on the same or another world size with nothing lost:
the optimizer state of each layout is in the checkpoint and lands on the rank that owns it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from distributed import RankFailed, run_ranks
from faulthelp import tiny_run
from memoryhelp import saved_by_blocks
from trainhelp import HIDE_CUDA, losses, make_run

from nanopt.config import ModelConfig, load_run

# 4 sequences of 16 tokens a step: 2 ranks accumulate 2 micro-batches of 1, 4 ranks take one each. A constant LR
# after warm-up, so that a session stopped early and one resumed follow the uninterrupted run's schedule.
SHORT = {"micro_batch_size": 1, "max_steps": 6, "lr_schedule": "constant", "warmup_steps": 2,
         "checkpoint_interval": 2, "eval_interval": 0}
KILLED_AT = 5  # every rank SIGKILLs itself as step 5 starts, once `latest` names step 4's checkpoint
# Losses of another layout or checkpointing granularity match DDP's up to the order of floating-point sums (the
# observed differences are below 1e-6); a lost optimizer state or a wrong recomputation moves them by 1e-3 or more.
TOLERANCE = 1e-5


def train_in_rank(run: Path, kill_at: int | None) -> dict:
    """`nanopt train RUN` in each torchrun worker; with `kill_at`, the rank SIGKILLs itself (no clean-up of any
    kind) as that step's first batch is read, once its checkpoint before is published."""
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    if kill_at is not None:
        _kill_at(kill_at, run / "checkpoints", f"step-{kill_at - 1:06d}")
    return train(load_run(run), TrainOptions())


def train_changed_in_rank(run: Path, overrides: dict) -> dict:
    """`nanopt train RUN --set ... --allow-changed` in each torchrun worker."""
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    return train(load_run(run, overrides), TrainOptions(allow_changed=True))


def _kill_at(step: int, checkpoints: Path, latest: str) -> None:
    import time

    from nanopt.data.loaders.loader import TrainLoader
    from nanopt.train.checkpoint import read_pointer

    original = TrainLoader.next_batch

    def next_batch(self):
        if self.step + 1 >= step and self.micro_step == 0:
            deadline = time.monotonic() + 60
            while read_pointer(checkpoints, "latest") != latest and time.monotonic() < deadline:
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    TrainLoader.next_batch = next_batch


def killed_then_resumed(run: Path, ranks: int, resume_ranks: int) -> dict[int, float]:
    with pytest.raises(RankFailed):
        run_ranks(train_in_rank, run, KILLED_AT, world_size=ranks, env=HIDE_CUDA)
    assert max(losses(run)) == KILLED_AT - 1
    run_ranks(train_in_rank, run, None, world_size=resume_ranks, env=HIDE_CUDA)
    return losses(run)


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> dict[int, float]:
    run = tiny_run(tmp_path_factory.mktemp("ddp"), tiny_dataset, "ddp", **SHORT)
    run_ranks(train_in_rank, run, None, env=HIDE_CUDA)
    got = losses(run)
    assert sorted(got) == list(range(1, 7))
    return got


def assert_like(expected: dict[int, float], got: dict[int, float], what: str) -> None:
    assert got.keys() == expected.keys(), (what, got)
    assert all(abs(expected[s] - got[s]) < TOLERANCE for s in got), (what, expected, got)


@pytest.mark.slow
@pytest.mark.parametrize(("settings", "ranks", "resume_ranks"), [
    ({"parallelism": "zero1"}, 2, 4),
    ({"parallelism": "zero1"}, 4, 2),
    ({"parallelism": "zero2"}, 2, 4),
    ({"parallelism": "fsdp_offload"}, 2, 4),
    ({"parallelism": "fsdp_offload"}, 4, 2),
    ({"parallelism": "fsdp", "activation_checkpointing": 2}, 2, 4),
    ({"parallelism": "ddp", "activation_checkpointing": "selective"}, 2, 4),
    ({"parallelism": "zero2", "activation_checkpointing": True}, 4, 2),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_each_rung_trains_like_ddp_and_resumes_after_a_kill_on_another_world_size(
        tmp_path: Path, tiny_dataset: Path, ddp_losses: dict, settings: dict, ranks: int, resume_ranks: int):
    run = tiny_run(tmp_path, tiny_dataset, "run", **SHORT, **settings)
    assert_like(ddp_losses, killed_then_resumed(run, ranks, resume_ranks), (settings, ranks, resume_ranks))


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["zero1", "fsdp_offload"])
def test_a_kill_and_resume_on_the_same_ranks_is_bit_exact(tmp_path: Path, tiny_dataset: Path, parallelism: str):
    straight = tiny_run(tmp_path, tiny_dataset, "straight", **SHORT, parallelism=parallelism)
    run_ranks(train_in_rank, straight, None, env=HIDE_CUDA)
    resumed = tiny_run(tmp_path, tiny_dataset, "resumed", **SHORT, parallelism=parallelism)
    assert killed_then_resumed(resumed, 2, 2) == losses(straight)


@pytest.mark.slow
@pytest.mark.parametrize(("written_by", "resumed_by"), [("fsdp_offload", "zero1"), ("zero1", "zero2")])
def test_a_checkpoint_of_one_rung_resumes_on_another(tmp_path: Path, tiny_dataset: Path, ddp_losses: dict,
                                                     written_by: str, resumed_by: str):
    """The optimizer state moves between layouts: FSDP2's DTensor shards into ZeRO-1's per-rank entries and back."""
    run = tiny_run(tmp_path, tiny_dataset, "run", **SHORT, parallelism=written_by)
    with pytest.raises(RankFailed):
        run_ranks(train_in_rank, run, KILLED_AT, env=HIDE_CUDA)
    run_ranks(train_changed_in_rank, run, {"parallelism": resumed_by}, world_size=4, env=HIDE_CUDA)
    assert_like(ddp_losses, losses(run), (written_by, resumed_by))


def zero1_state_in_rank(run: Path) -> dict:
    """What a ZeRO-1 rank holds after a step: its optimizer entries, by parameter name."""
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session
    from nanopt.train.step import step

    s = build_session(load_run(run), init_runtime("fp32"))
    step(s)
    from nanopt.train.parallel.wrap import sharded_state

    state = sharded_state(s.prepared, s.optimizer)["optimizer"]
    return {"owned": sorted(state["state"]), "groups": [g["params"] for g in state["param_groups"]],
            "every": sorted(name for name, _ in s.prepared.raw.named_parameters()),
            "moments": sum(t.numel() for e in state["state"].values() for t in e.values() if t.dim() > 0)}


def test_zero1_shards_the_optimizer_state_and_lists_every_parameter(tmp_path: Path, tiny_dataset: Path):
    run = tiny_run(tmp_path, tiny_dataset, "run", **SHORT, parallelism="zero1")
    first, second = run_ranks(zero1_state_in_rank, run, env=HIDE_CUDA)
    assert not set(first["owned"]) & set(second["owned"])  # each parameter's moments on one rank only ...
    assert sorted(first["owned"] + second["owned"]) == first["every"]  # ... and every parameter's somewhere
    assert first["groups"] == second["groups"] and sorted(sum(first["groups"], [])) == first["every"]
    assert first["owned"] and second["owned"] and first["moments"] and second["moments"]  # both ranks hold a share


@pytest.mark.parametrize(("settings", "message"), [
    ({"activation_checkpointing": 0}, "'activation_checkpointing': 0 is not a block interval"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing"),
    ({"parallelism": "zero3"}, "parallelism"),
    ({"optimizer": "muon", "parallelism": "zero1"}, "\"muon\" does not run with \"parallelism\": \"zero1\""),
    ({"optimizer": "muon", "parallelism": "fsdp_offload"}, "\"parallelism\": \"fsdp_offload\""),
    ({"optimizer": "adamw8bit", "parallelism": "zero1"}, "\"adamw8bit\" does not run with \"parallelism\": \"zero1\""),
])
def test_bad_ladder_settings_are_one_line_errors(tmp_path: Path, tiny_dataset: Path, cli_in_process, settings: dict,
                                                 message: str):
    run = tiny_run(tmp_path, tiny_dataset, "run", **settings)
    assert_user_error(cli_in_process("train", run, "--no-live"), message)
    assert not (run / "checkpoints").exists()


def test_checkpointed_blocks_per_granularity():
    from nanopt.model.memory import checkpointed_blocks

    assert checkpointed_blocks(False, 6) == []
    assert checkpointed_blocks(True, 6) == checkpointed_blocks("selective", 6) == list(range(6))
    assert checkpointed_blocks(2, 6) == [1, 3, 5]
    assert checkpointed_blocks(4, 6) == [3]
    assert torch.is_grad_enabled()


# ------------------------------------------------------------------------------------------ the memory model per rung

# Every dimension divisible by 4: FSDP2's shards are then exact (no padding) on 2 and 4 ranks.
MEASURED_MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 32}
RUNGS = ["ddp", "zero1", "zero2", "fsdp", "fsdp_offload"]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: its local shard): what is really allocated."""
    seen = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def allocated_states_in_rank(run: Path, parallelism: str) -> dict:
    """One training step of `parallelism` on this rank, gradients kept: the bytes its weights, gradients and
    optimizer state hold, and (zero2) the bytes of the blocks' weights between forward and backward."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from nanopt.runtime import init_runtime
    from nanopt.train.health.probe import HealthProbe
    from nanopt.train.session import build_session

    s = build_session(load_run(run, {"parallelism": parallelism}), init_runtime("fp32"))
    inputs, targets = s.loader.next_batch()
    loss = s.prepared.model(inputs, targets)
    between = _storage_bytes(p for block in s.prepared.raw.layers for p in block.parameters())
    loss.backward()
    probe = HealthProbe(s.prepared.raw, s.optimizer, s.rt)  # as a log step with run health on runs the update
    probe.before_update()
    snapshot = _storage_bytes(probe.snapshot)
    s.optimizer.step()
    probe.after_update()
    params = list(s.prepared.raw.parameters())
    local = s.optimizer.optim if isinstance(s.optimizer, ZeroRedundancyOptimizer) else s.optimizer
    state = [t for entry in local.state.values() for t in entry.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"weights": _storage_bytes(params), "gradients": _storage_bytes(p.grad for p in params),
            "optimizer": _storage_bytes(state), "between": between, "health_snapshot": snapshot,
            "on_cpu": all(p.device.type == "cpu" for p in params)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_parameter_of_each_rung_are_the_tensors_allocated(tmp_path: Path, tiny_dataset: Path, world: int):
    """The memory model's weights, gradients and optimizer state (host memory for fsdp_offload) per rank against
    the storage the ranks really hold after a step, averaged over the ranks (ZeRO-1 gives each rank whole
    tensors, so one rank may hold a tensor more than the mean), within 2%."""
    from nanopt.model.memory import estimate_memory

    run = make_run(tmp_path, tiny_dataset, "run", model=MEASURED_MODEL, **{**SHORT, "global_batch_tokens": 128})
    cfg = load_run(run)
    for parallelism in RUNGS:
        ranks = run_ranks(allocated_states_in_rank, run, parallelism, world_size=world, env=HIDE_CUDA)

        def model(choice: str):
            return estimate_memory(cfg.model, cfg.seq_len, precision="fp32", compiled=False,
                                   activation_checkpointing=False, parallelism=choice, world_size=world, cuda=False,
                                   health=True)

        predicted = model(parallelism)
        if parallelism == "fsdp_offload":  # fsdp's shards, all in host memory, none on the device
            assert predicted.weights == predicted.gradients == predicted.optimizer == predicted.health_snapshot == 0
            assert all(r["on_cpu"] for r in ranks)
            assert predicted.host == sum(getattr(model("fsdp"), part) for part in STATES)
            predicted = model("fsdp")
        for part in STATES:
            measured = sum(r[part] for r in ranks) / world
            assert measured == pytest.approx(getattr(predicted, part), rel=0.02), (parallelism, part, measured)
        if parallelism == "zero2":  # every block's gathered weights are alive from forward to backward
            between = sum(r["between"] for r in ranks) / world
            assert between == pytest.approx(predicted.gathered, rel=0.02), (between, predicted.gathered)


STATES = ("weights", "gradients", "optimizer", "health_snapshot")


def test_run_healths_copy_of_the_weights_is_what_the_memory_model_adds_at_a_log_steps_update(tmp_path: Path,
                                                                                            tiny_dataset: Path):
    """The probe's copy, taken before a log step's update, against the model's `health_snapshot` (none with health
    off); and the update is the peak where nothing else is larger (every block recomputed, micro-batch 1)."""
    from nanopt.model.memory import estimate_memory

    run = make_run(tmp_path, tiny_dataset, "run", model=MEASURED_MODEL, **{**SHORT, "global_batch_tokens": 128})
    cfg = load_run(run)
    [measured] = run_ranks(allocated_states_in_rank, run, "ddp", world_size=1, env=HIDE_CUDA)

    def model(health: bool, checkpointing: bool = False):
        return estimate_memory(cfg.model, cfg.seq_len, precision="fp32", compiled=False, cuda=False,
                               activation_checkpointing=checkpointing, parallelism="ddp", world_size=1,
                               health=health)

    assert measured["health_snapshot"] == pytest.approx(model(True).health_snapshot, rel=0.02)
    assert model(True).health_snapshot == model(True).weights and model(False).health_snapshot == 0
    lean_on, lean_off = model(True, checkpointing=True), model(False, checkpointing=True)
    update = lean_on.weights + lean_on.gradients + lean_on.optimizer + lean_on.runtime_overhead + lean_on.weights
    assert lean_on.total(1) == update > lean_off.total(1)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("granularity", [False, True, 2, 3, "selective"])
def test_activation_bytes_per_granularity_are_what_backward_keeps(architecture: str, granularity):
    """The memory model's bytes the blocks keep for backward, against the bytes really saved (fp32 on the CPU,
    where SDPA runs its flash kernel as the model assumes), within 10%."""
    from nanopt.model.memory import block_activation_bytes_per_token
    from nanopt.model.transformer import Transformer
    from nanopt.train.parallel.recompute import apply_activation_checkpointing

    gpt2 = {"architecture": "gpt2", "num_key_value_heads": 4} if architecture == "gpt2" else {}
    cfg = ModelConfig(**{"architecture": "llama", "vocab_size": 512, **MEASURED_MODEL, "num_hidden_layers": 6,
                         "max_position_embeddings": 128, **gpt2})
    torch.manual_seed(0)
    model = Transformer(cfg)
    apply_activation_checkpointing(model, granularity)
    batch = torch.randint(0, cfg.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    measured = saved_by_blocks(model, batch) / (2 * 128)
    kept, _ = block_activation_bytes_per_token(cfg, 4, False, granularity)
    assert measured == pytest.approx(kept, rel=0.10), (measured, kept)


# ------------------------------------------------------------------------------------------ 8-bit AdamW (torchao)

EIGHT_BIT = {**SHORT, "optimizer": "adamw8bit"}


@pytest.mark.slow
def test_adamw8bit_resumes_exactly_after_a_kill_and_on_another_world_size(tmp_path: Path, tiny_dataset: Path):
    pytest.importorskip("torchao")
    from safetensors import safe_open

    from nanopt.train import checkpoint as ckpt

    straight = tiny_run(tmp_path, tiny_dataset, "straight", **EIGHT_BIT)
    run_ranks(train_in_rank, straight, None, world_size=1, env=HIDE_CUDA)
    resumed = tiny_run(tmp_path, tiny_dataset, "resumed", **EIGHT_BIT)
    assert killed_then_resumed(resumed, 1, 1) == losses(straight)  # one process: bit for bit
    with safe_open(ckpt.resolve(resumed, "latest").path / "optimizer.safetensors", "pt") as stored:
        codes = [key for key in stored.keys() if key.endswith("/exp_avg_sq_codes")]
        assert codes and stored.get_tensor(codes[0]).dtype == torch.uint8  # the 8-bit moments themselves
    # Two DDP ranks write DCP shards; one process resumes them (and the reverse would too: the same conversion).
    sharded = tiny_run(tmp_path, tiny_dataset, "sharded", **EIGHT_BIT)
    assert_like(losses(straight), killed_then_resumed(sharded, 2, 1), "adamw8bit 2 -> 1 ranks")


def test_adamw8bit_state_is_the_bytes_the_memory_model_counts():
    pytest.importorskip("torchao")
    from nanopt.model.memory import ADAM_8BIT_BYTES, states_only
    from nanopt.model.transformer import Transformer
    from nanopt.train.optim.lowbit import build_adamw8bit
    from nanopt.train.optim.optimizer import decay_groups

    # Each quantized tensor carries a 1 KiB code book per moment, which the model leaves out: a model of a few
    # million parameters makes it what it is in real ones, a fraction of a percent.
    cfg = ModelConfig(**{"architecture": "llama", "vocab_size": 512, **MEASURED_MODEL, "hidden_size": 256,
                         "intermediate_size": 1024})
    model = Transformer(cfg)
    optimizer = build_adamw8bit(decay_groups(list(model.parameters()), 0.1), 1e-3, (0.9, 0.95), 1e-8)
    batch = torch.randint(0, cfg.vocab_size, (2, 33))
    model(batch[:, :-1], batch[:, 1:]).backward()
    # The state is made before torchao's compiled update runs, and that update writes it in place: eager, the same
    # bytes without half a minute of compiling every parameter shape on a fresh machine.
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    tensors = [part for entry in optimizer.state.values() for value in entry.values() if value.dim() > 0
               for part in ([value.codes, value.scale, value.qmap] if hasattr(value, "codes") else [value])]
    params = sum(p.numel() for p in model.parameters())
    predicted = states_only(params, 1, adam_bytes=ADAM_8BIT_BYTES, parallelism="ddp").optimizer
    assert _storage_bytes(tensors) == pytest.approx(predicted, rel=0.02)
    assert _storage_bytes(tensors) < 0.3 * 8 * params  # against AdamW's 8 bytes a parameter


# Rows of 256 values (hidden_size 256): every matrix's moments are 8-bit on 1, 2 and 4 ranks, in the same blocks.
EIGHT_BIT_MODEL = {**MEASURED_MODEL, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
EIGHT_BIT_HANG_GUARD_S = 600


def _codes_in_index(run: Path) -> dict[str, tuple]:
    """{key: (shape, dtype)} of the 8-bit codes the latest (sharded) checkpoint's index lists."""
    from nanopt.train import checkpoint as ckpt
    from nanopt.train.checkpoint import sharded

    specs = sharded.stored_specs(ckpt.resolve(run, "latest").path)
    return {key: spec for key, spec in specs.items() if key.endswith("_codes")}


@pytest.mark.slow
def test_adamw8bit_under_fsdp2_resumes_exactly_after_a_kill_and_on_another_world_size(tmp_path: Path,
                                                                                      tiny_dataset: Path):
    """FSDP2's ranks each quantize their own rows; the checkpoint holds the 8-bit codes and scales sharded by rows,
    and a kill on 2 ranks resumes bit for bit on 2, and on 4 ranks (zero2: another FSDP2 layout) to the same
    losses within the order of floating-point sums."""
    pytest.importorskip("torchao")
    settings = {**EIGHT_BIT, "parallelism": "fsdp"}
    straight = make_run(tmp_path, tiny_dataset, "straight", model=EIGHT_BIT_MODEL, **settings)
    run_ranks(train_in_rank, straight, None, env=HIDE_CUDA)
    same = make_run(tmp_path, tiny_dataset, "same", model=EIGHT_BIT_MODEL, **settings)
    assert killed_then_resumed(same, 2, 2) == losses(straight)
    codes = _codes_in_index(same)
    assert "optimizer.state.layers.0.mlp.down_proj.weight.exp_avg_codes" in codes, sorted(codes)
    assert all(dtype == "uint8" for _, dtype in codes.values())
    other = make_run(tmp_path, tiny_dataset, "other", model=EIGHT_BIT_MODEL, **settings)
    with pytest.raises(RankFailed):
        run_ranks(train_in_rank, other, KILLED_AT, env=HIDE_CUDA)
    assert max(losses(other)) == KILLED_AT - 1
    # Four ranks each compile torchao's step for every shape of shard on a loaded CPU: a longer guard against hangs.
    run_ranks(train_changed_in_rank, other, {"parallelism": "zero2"}, world_size=4, env=HIDE_CUDA,
              timeout=EIGHT_BIT_HANG_GUARD_S)
    assert_like(losses(straight), losses(other), "adamw8bit fsdp 2 -> zero2 4 ranks")


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The plain tensors behind an optimizer's state: an 8-bit moment's codes, scales and code book (DTensor: this
    rank's)."""
    tensors = []
    for entry in optimizer.state.values():
        for value in entry.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if hasattr(local, "codes"):
                tensors += [local.codes, local.scale, local.qmap]
            elif local.dim() > 0:
                tensors.append(local)
    return tensors


def eight_bit_state_in_rank(run: Path, parallelism: str) -> dict:
    """The bytes of this rank's 8-bit AdamW state after one step of `parallelism`, and how many moments are 8-bit."""
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session
    from nanopt.train.step import step

    s = build_session(load_run(run, {"parallelism": parallelism}), init_runtime("fp32"))
    step(s)
    tensors = _state_tensors(s.optimizer)
    return {"bytes": _storage_bytes(tensors), "codes": sum(t.dtype == torch.uint8 for t in tensors)}


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["fsdp", "fsdp_offload"])
def test_adamw8bit_state_under_fsdp2_is_the_sharded_bytes_the_memory_model_counts(
        tmp_path: Path, tiny_dataset: Path, parallelism: str):
    """Each of 2 ranks holds half the 8-bit moments (host memory under offload): the memory model's 2 + 1/32 bytes
    a parameter over the world size, against the storage really allocated, within 2%."""
    pytest.importorskip("torchao")
    from nanopt.model.memory import estimate_memory

    model = {**EIGHT_BIT_MODEL, "hidden_size": 512, "intermediate_size": 2048}  # code books: a fraction of a %
    run = make_run(tmp_path, tiny_dataset, "run", model=model, optimizer="adamw8bit",
                   **{**SHORT, "global_batch_tokens": 128})
    cfg = load_run(run)
    ranks = run_ranks(eight_bit_state_in_rank, run, parallelism, env=HIDE_CUDA)
    predicted = estimate_memory(cfg.model, cfg.seq_len, precision="fp32", compiled=False, optimizer="adamw8bit",
                                activation_checkpointing=False, parallelism="fsdp", world_size=2, cuda=False)
    assert all(r["codes"] >= 2 * 7 * 2 for r in ranks)  # both moments of every block matrix are 8-bit on each rank
    measured = sum(r["bytes"] for r in ranks) / 2
    assert measured == pytest.approx(predicted.optimizer, rel=0.02), (measured, predicted.optimizer)


def test_adamw8bit_moments_that_another_world_size_cannot_hold_are_refused_in_one_line():
    """Rows of 128 values: two rows make a 256-value block. On 2 ranks a 128-row projection splits into 64 rows each
    (8-bit); on 3 ranks into 43, 43 and 42 (fp32): the blocks 2 ranks stored cannot be dealt out to 3, and the
    resume is refused before anything is read, saying why and what to do; the same layout passes."""
    from nanopt.errors import CheckpointError
    from nanopt.train.optim.lowbit import check_stored_moments, quantizes

    shape = (128, 128)
    assert quantizes(shape, 2) and not quantizes(shape, 3)
    stored_8bit = {f"optimizer.state.w.{moment}_{part}" for moment in ("exp_avg", "exp_avg_sq")
                   for part in ("codes", "scale", "qmap")} | {"optimizer.state.w.step"}
    held_fp32 = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(shape),
                                 "exp_avg_sq": torch.zeros(shape)}}}
    with pytest.raises(CheckpointError, match=r"'w' is stored in 8 bits, and 3 rank\(s\) hold it in fp32") as refused:
        check_stored_moments(held_fp32, stored_8bit, "ckpt", 3)
    assert "resume on the number of ranks that wrote the checkpoint" in refused.value.hint
    held_8bit = {"state": {"w": {key.removeprefix("optimizer.state.w."): torch.zeros(1) for key in stored_8bit}}}
    check_stored_moments(held_8bit, stored_8bit, "ckpt", 2)
    stored_fp32 = {f"optimizer.state.w.{name}" for name in held_fp32["state"]["w"]}
    with pytest.raises(CheckpointError, match=r"is stored in fp32, and 2 rank\(s\) hold it in 8 bits"):
        check_stored_moments(held_8bit, stored_fp32, "ckpt", 2)


@pytest.mark.parametrize("shape", [(512, 16), (320, 16), (100, 48), (4096,), (4352,), (64, 64), (63, 64), (128, 896),
                                   (50257, 768), (10, 10)])
def test_one_process_quantizes_what_torchao_does_and_fsdp2_shards_whole_blocks(shape: tuple):
    """On one process a moment is 8-bit exactly when torchao's own AdamW8bit makes it so (4096 values or more, a
    multiple of 256); on more ranks only where every shard is a whole number of blocks, as FSDP2 splits the rows."""
    import math

    from nanopt.train.optim.lowbit import BLOCK, quantizes, rows_per_block_group, shard_rows

    numel = math.prod(shape)
    assert quantizes(shape, 1) == (numel >= 4096 and numel % 256 == 0)
    row = numel // shape[0]
    for world in (2, 3, 4, 8):
        rows = shard_rows(shape[0], world)
        assert sum(rows) == shape[0] and rows == [len(chunk) for chunk in torch.arange(shape[0]).chunk(world)] + \
            [0] * (world - len(torch.arange(shape[0]).chunk(world)))
        if quantizes(shape, world):
            assert all(r > 0 and r * row % BLOCK == 0 for r in rows) and rows_per_block_group(shape) * row % BLOCK == 0
