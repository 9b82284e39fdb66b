"""Sequence-length stages (train.json seq_len_stages, nanopt.config.seq_stages, nanopt.data.loaders.staged_loader):
where a stage starts and what it trains, the learning rate across a boundary, each stage's windows read once on any
world size, the estimate / find-batch / preflight at the longest stage, the one-line refusals, and exact resume across a
boundary by real killed processes on one and two ranks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clihelp import assert_user_error
from faulthelp import TINY_MODEL, Launcher
from mixturehelp import mixture
from trainhelp import losses, make_run

from nanopt.config.seq_stages import SeqStage, stage_tokens
from nanopt.train import checkpoint as ckpt

MODEL = {"architecture": "llama", "vocab_size": 64, **TINY_MODEL, "max_position_embeddings": 2048}


def _run(**train):
    from nanopt.config import ModelConfig, RunConfig, TrainConfig

    cfg = TrainConfig(**{"data": "d", "micro_batch_size": 4, "seq_len": 1024, "global_batch_tokens": 8192,
                         "train_tokens": 1_000_000, "seq_len_stages": [{"from": 0.9, "seq_len": 2048}], **train})
    model = ModelConfig(**MODEL)
    cfg.validate(model, look_up_data=False)
    return RunConfig(run_dir=Path("r"), model=model, train=cfg)


def test_the_stage_boundary_and_token_counts_golden():
    run = _run()
    # 1,000,000 tokens in steps of 8,192: 123 steps (the budget is unchanged by stages); 0.9 x 123 = 110.7 -> 111
    assert run.total_steps == 123 and run.total_tokens == 123 * 8192
    assert run.seq_stages == (SeqStage(0, 1024, 4), SeqStage(111, 2048, 2))  # a micro-batch keeps its 4,096 tokens
    assert stage_tokens(run.seq_stages, run.total_steps, 8192) == [909_312, 98_304]
    assert _run(seq_len_stages=[{"from": 50, "seq_len": 512}, {"from": 100, "seq_len": 2048}]).seq_stages == (
        SeqStage(0, 1024, 4), SeqStage(50, 512, 8), SeqStage(100, 2048, 2))


def test_the_learning_rate_is_continuous_across_the_boundary():
    from nanopt.train.optim.schedule import scheduled_lr

    staged, plain = _run(warmup_steps=10).train, _run(warmup_steps=10, seq_len_stages=None).train
    lrs = [scheduled_lr(k, 123, staged) for k in range(123)]
    # every step trains global_batch_tokens whatever its length: the schedule is the run's without stages
    assert lrs == [scheduled_lr(k, 123, plain) for k in range(123)]
    steps = np.abs(np.diff(lrs))
    # 110 -> 111 (the boundary) moves the LR by as much as the steps either side of it do: no jump, no pause
    assert min(steps[109], steps[111]) <= steps[110] <= max(steps[109], steps[111])
    assert lrs[-1] == pytest.approx(staged.learning_rate * staged.min_lr_ratio)


# seq_len 16 -> 32 from step 5, 128 tokens a step: stage 0 reads 8 sequences of 16 a step, stage 1 4 of 32.
STAGES = (SeqStage(0, 16, 4), SeqStage(5, 32, 2))


def _handed(loader, steps):
    """[(step, the window starts of its samples, in the order handed out, and the input tokens)] on one rank."""
    out = []
    for step in range(steps):
        starts, inputs = [], []
        for _ in range(loader.accum_at(step)):
            current = loader.current
            starts.extend(current._starts().tolist())
            batch = loader.next_batch()[0]
            assert batch.shape == (current.micro_batch_size, current.seq_len)
            inputs.append(batch.numpy())
        out.append((starts, np.concatenate(inputs)))
    return out


def test_the_loader_hands_each_stages_windows_once_from_where_the_tokens_put_it(tiny_dataset: Path):
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loaders.permutation import FeistelPermutation
    from nanopt.data.loaders.staged_loader import StagedLoader

    dataset = TokenDataset.open(tiny_dataset)
    one = StagedLoader(dataset, "train", STAGES, 2, 0, 1, seed=3)
    handed = _handed(one, 10)
    stream = dataset.stream("train")
    for stage, steps in ((STAGES[0], range(0, 5)), (STAGES[1], range(5, 10))):
        length = stage.seq_len
        starts = [s for step in steps for s in handed[step][0]]
        # stage 1 starts at sample 5 x 128 / 32 = 20 of its own order: where the 640 tokens before it put it
        first = steps[0] * 128 // length
        order = FeistelPermutation((stream.total - 1) // length, 3, 0)
        assert starts == (order(np.arange(first, first + len(starts))) * length).tolist()
        assert len(set(starts)) == len(starts) == 5 * 128 // length  # each window once
        tokens = np.concatenate([handed[step][1] for step in steps])
        assert (tokens == stream.windows(np.array(starts), length + 1)[:, :-1]).all()
    # two ranks (base micro-batch 2, stage 1 micro-batch 1) read the same windows per step between them
    ranks = [_handed(StagedLoader(dataset, "train", (SeqStage(0, 16, 2), SeqStage(5, 32, 1)), 2, rank, 2, seed=3),
                     10) for rank in range(2)]
    for step in range(10):
        assert sorted(handed[step][0]) == sorted(ranks[0][step][0] + ranks[1][step][0])
    assert one.epochs_at(5) == pytest.approx(20 / ((stream.total - 1) // 16 // 2))  # 20 of 16-token windows


def test_the_loader_state_resumes_in_its_stage(tiny_dataset: Path):
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loaders.staged_loader import StagedLoader
    from nanopt.errors import ResumeError

    dataset = TokenDataset.open(tiny_dataset)
    loader = StagedLoader(dataset, "train", STAGES, 2, 0, 1, seed=3)
    for _ in range(13):  # steps 0-4 (10 micro-batches), step 5 and half of step 6
        loader.next_batch()
    state = loader.state_dict()
    assert (state["step"], state["micro_step"], state["seq_len"]) == (6, 1, 32)
    rest = [loader.next_batch()[0] for _ in range(5)]
    again = StagedLoader(dataset, "train", STAGES, 2, 0, 1, seed=3)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert all((a == b).all() for a, b in zip(rest, [again.next_batch()[0] for _ in range(5)], strict=True))
    moved = StagedLoader(dataset, "train", (SeqStage(0, 16, 4), SeqStage(8, 32, 2)), 2, 0, 1, seed=3)
    with pytest.raises(ResumeError, match="seq_len was 32 in the checkpoint and is 16 now"):
        moved.load_state_dict(state)  # the stage moved past the checkpoint (a budget changed): not read wrongly


# Tiny model with 32 positions; seq_len 16, then 32 from 0.5 x 14 = step 7 (logged as step 8). A micro-batch is 4 x 16
# or 2 x 32; one rank accumulates 2, two ranks 1.
STAGED = {"seq_len": 16, "micro_batch_size": 4, "global_batch_tokens": 128, "max_steps": 14,
          "seq_len_stages": [{"from": 0.5, "seq_len": 32}], "checkpoint_interval": 4, "eval_interval": 7,
          "warmup_steps": 2, "log_interval": 1}
STAGED_MODEL = {**TINY_MODEL, "max_position_embeddings": 32}


@pytest.mark.slow
def test_a_run_killed_before_the_stage_boundary_resumes_exactly_on_one_or_two_ranks(tmp_path: Path,
                                                                                   tiny_dataset: Path,
                                                                                   launcher: Launcher):
    whole = make_run(tmp_path, tiny_dataset, "whole", model=STAGED_MODEL, **STAGED)
    started = launcher.train(whole)
    said = started.stderr + started.stdout
    assert "then seq_len 32 from step 8 (micro-batch 2)" in said and "step 8: seq_len 32 from here on" in said
    expected = losses(whole)
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records if r["kind"] == "train"] == [128 * k for k in range(1, 15)]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [7, 14]  # at the base seq_len, either side

    for name, args in (("one", ()), ("two", ("--nproc-per-node", "2"))):
        run = make_run(tmp_path, tiny_dataset, name, model=STAGED_MODEL, **STAGED)
        killed = launcher.start("train", run, "--no-live", kill_at_step={
            "step": 6, "checkpoints": str(run / "checkpoints"), "latest": "step-000004"})
        assert launcher.wait(killed) != 0 and ckpt.resolve(run, "latest").step == 4  # SIGKILLed in step 6
        resumed = launcher.train(run, *args)  # resumes at step 4, crosses the boundary at step 8
        assert "step 8: seq_len 32 from here on" in resumed.stderr + resumed.stdout
        got = losses(run)
        assert ckpt.resolve(run, "latest").meta["world_size"] == (2 if args else 1)
        assert ckpt.resolve(run, "latest").meta["ranks"][0]["loader"]["seq_len"] == 32
        if args:  # two ranks sum the same samples in another order
            assert got == pytest.approx(expected, rel=1e-5), name
        else:
            assert got == expected, name


@pytest.mark.parametrize("stages, words", [
    ([{"from": 0.5, "seq_len": 64}], ("seq_len_stages[0]", "64", "max_position_embeddings 32")),
    ([{"from": 0.5, "seq_len": 24}], ("seq_len_stages[0]", "24", "whole sequences")),
    ([{"from": 1.5, "seq_len": 32}], ("seq_len_stages[0]", "'from' 1.5")),
    ([{"from": 20, "seq_len": 32}], ("seq_len_stages[0]", "outside the run's steps 1 to 13")),
    ([{"from": 0.5, "seq_len": 16}], ("seq_len_stages[0]", "stage before it")),
    ([{"from": 0.5, "seq_len": 32}, {"from": 0.3, "seq_len": 16}], ("seq_len_stages[1]", "not after")),
    ([{"from": 0.5}], ("seq_len_stages[0]", "exactly 'from' and 'seq_len'")),
    ({"from": 0.5, "seq_len": 32}, ("seq_len_stages", "not a JSON list")),
    ([], ("seq_len_stages", "not a non-empty list")),
])
def test_a_bad_stage_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process, stages, words):
    run = make_run(tmp_path, tiny_dataset, model=STAGED_MODEL, **{**STAGED, "seq_len_stages": stages})
    assert_user_error(cli_in_process("train", run), *words)
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_stages_with_batch_warmup_or_a_mixture_are_one_line(tmp_path: Path, tiny_dataset: Path,
                                                            mixture_sources: dict[str, Path], cli_in_process):
    ramp = make_run(tmp_path, tiny_dataset, "ramp", model=STAGED_MODEL, batch_warmup_tokens=512,
                    batch_warmup_start_tokens=64, **STAGED)
    assert_user_error(cli_in_process("train", ramp), "seq_len_stages", "batch warmup")
    mixed = make_run(tmp_path, mixture_sources["web"], "mixed", model=STAGED_MODEL,
                     **{**STAGED, "data": mixture(mixture_sources)})
    assert_user_error(cli_in_process("train", mixed), "seq_len_stages", "mixture")


def _staged_run(tmp_path: Path, tiny_dataset: Path, **train):
    from nanopt.config import load_run

    return load_run(make_run(tmp_path, tiny_dataset, model=STAGED_MODEL, **{**STAGED, **train}))


def test_estimate_weights_the_flops_by_stage_and_judges_memory_at_the_longest(tmp_path: Path, tiny_dataset: Path):
    from nanopt.model.flops import flops_per_token
    from nanopt.model.memory import estimate_memory
    from nanopt.plan.estimate import EstimateOptions, estimate

    run = _staged_run(tmp_path, tiny_dataset)
    report = estimate(run, EstimateOptions())
    assert report["seq_len_stages"] == [{"first_step": 1, "seq_len": 16, "micro_batch_size": 4, "tokens": 896},
                                        {"first_step": 8, "seq_len": 32, "micro_batch_size": 2, "tokens": 896}]
    half = (flops_per_token(run.model, 16) + flops_per_token(run.model, 32)) / 2
    assert report["flops_per_token"] == pytest.approx(half) and report["total_flops"] == pytest.approx(14 * 128 * half)
    assert report["memory_assumptions"]["micro_batch_size"] == 2  # the 32-token stage's micro-batch
    assumed = report["memory_assumptions"]
    at = {length: estimate_memory(run.model, length, precision=assumed["precision"], compiled=assumed["compile"],
                                  activation_checkpointing=False, parallelism="ddp", world_size=1, optimizer="adamw",
                                  cuda=True).activations_per_sequence for length in (16, 32)}
    assert report["memory_bytes"]["activations_per_sequence"] == at[32] != at[16]


def test_find_batch_tries_sizes_whole_in_every_stage_at_the_longest_shape(tmp_path: Path, tiny_dataset: Path):
    from nanopt.plan.find_batch.search import trial_run, usable_micro_batches

    run = _staged_run(tmp_path, tiny_dataset, global_batch_tokens=16 * 12)
    assert usable_micro_batches(run.train, 16, 1, 64) == [2, 4, 6, 12]  # 1 and 3 are half a 32-token sequence
    trial = trial_run(run, 4, 1)
    # 4 x 16 tokens a micro-batch accumulate to the global batch of 192: a trial steps two micro-batches
    assert (trial.seq_len, trial.train.micro_batch_size, trial.train.global_batch_tokens) == (32, 2, 128)
    assert trial.train.seq_len_stages is None


def test_preflight_times_the_longest_stage(tmp_path: Path, tiny_dataset: Path):
    from nanopt.model.flops import flops_per_token
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session
    from nanopt.train.shape_schedule import skip_to_the_longest_stage
    from nanopt.train.step import step

    session = build_session(_staged_run(tmp_path, tiny_dataset), init_runtime("fp32"), writes=False)
    assert session.flops_per_token == pytest.approx((flops_per_token(session.run.model, 16) +
                                                     flops_per_token(session.run.model, 32)) / 2)  # the run's
    skip_to_the_longest_stage(session)
    assert (session.state.step, session.state.tokens, session.loader.seq_len) == (7, 7 * 128, 32)
    assert session.flops_per_token == flops_per_token(session.run.model, 32)  # its measured steps' MFU
    step(session)
    assert (session.state.step, session.state.tokens, session.loader.current.micro_batch_size) == (8, 8 * 128, 2)


def test_preflight_says_it_measured_the_longest_stage_and_goes_stale_when_the_stages_change(tmp_path: Path,
                                                                                           tiny_dataset: Path,
                                                                                           cli_in_process):
    from nanopt.config import load_run
    from nanopt.plan.estimate import EstimateOptions, estimate

    run = make_run(tmp_path, tiny_dataset, model=STAGED_MODEL, **STAGED)
    result = cli_in_process("preflight", run, "--steps", "2", "--warmup", "1")
    assert result.returncode in (0, 3), result.stderr  # 3: a check failed (a loaded machine's loader wait)
    assert "steps at the longest seq_len stage, 32" in " ".join(result.stdout.split())
    report = json.loads((run / "preflight.json").read_text())
    assert report["steps"]["seq_len"] == 32 and report["fingerprint"]["seq_len_stages"] == STAGED["seq_len_stages"]
    (run / "train.json").write_text(json.dumps({**json.loads((run / "train.json").read_text()),
                                                "seq_len_stages": [{"from": 0.8, "seq_len": 32}]}))
    source = estimate(load_run(run), EstimateOptions())["throughput_source"]
    assert source["kind"] == "assumed" and "seq_len_stages" in source["note"]


def test_the_stages_cannot_change_on_resume_even_when_asked():
    """Every step's samples follow from the stages: changed, a checkpoint's step would point at other data."""
    from nanopt.config import ModelConfig, RunConfig, TrainConfig
    from nanopt.errors import ResumeError
    from nanopt.train.checkpoint.resume import check_resumable

    model = ModelConfig(**{"architecture": "llama", "vocab_size": 64, **STAGED_MODEL})
    saved = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(data="d", **STAGED)).snapshot()
    meta = {"config": saved, "world_size": 1, "data_fingerprint": "f"}
    changed = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(
        data="d", **{**STAGED, "seq_len_stages": [{"from": 0.8, "seq_len": 32}]}))
    with pytest.raises(ResumeError, match="cannot resume.*seq_len_stages"):
        check_resumable(meta, changed, "f", allow_changed=True, world_size=1)


def test_a_resume_on_more_ranks_lowers_the_micro_batch_to_one_whole_in_every_stage(tmp_path: Path,
                                                                                   tiny_dataset: Path):
    from nanopt.train.parallel.world_fit import micro_batch_for_world

    # 192 tokens a step, micro-batch 4 x 16 (2 x 32 in the stage): accumulation 3 on one rank. On two ranks each
    # takes 6 sequences of 16 a step: 4 does not divide them; 3 would, but is a sequence and a half of 32.
    run = _staged_run(tmp_path, tiny_dataset, global_batch_tokens=192)
    (run.run_dir / "checkpoints" / "step-000004").mkdir(parents=True)
    fitted, note = micro_batch_for_world(run, 2, "auto")
    assert fitted.train.micro_batch_size == 2 and "this session uses 2" in note
    assert [stage.micro_batch_size for stage in fitted.seq_stages] == [2, 1]
