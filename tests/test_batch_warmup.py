"""Batch-size warmup (train.json batch_warmup_tokens / batch_warmup_start_tokens, nanopt.config.batch_ramp): the batch
of every step, the tokens before it, the step count of a token budget, the loader's samples on any world size, the
learning rate by tokens, the one-line refusals, and exact resume across a level boundary by real killed processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clihelp import assert_user_error
from faulthelp import TINY_MODEL, Launcher
from mixturehelp import mixture
from trainhelp import losses, make_run

from nanopt.config.batch_ramp import BatchRamp, Level
from nanopt.train import checkpoint as ckpt


def test_the_ramp_levels_golden():
    # start 1024, target 8192 (J = 8), over 100,000 tokens: level j runs while the tokens before a step are below
    # ceil(j x 100,000 / 7); level 1 to 14,286 takes 14 steps of 1,024 (14,336), level 2 to 28,572 takes 7 of 2,048 ...
    ramp = BatchRamp(1024, 8192, 100_000)
    assert ramp.levels == (Level(0, 0, 1024), Level(14, 14336, 2048), Level(21, 28672, 3072),
                           Level(26, 44032, 4096), Level(30, 60416, 5120), Level(33, 75776, 6144),
                           Level(35, 88064, 7168), Level(37, 102400, 8192))
    assert ramp.ramp_steps == 37
    assert [ramp.tokens_in(k) for k in (0, 13, 14, 36, 37, 10_000)] == [1024, 1024, 2048, 7168, 8192, 8192]
    assert ramp.tokens_before(40) == 102400 + 3 * 8192
    assert ramp.steps_for(1_000_000) == 37 + 110  # ceil((1,000,000 - 102,400) / 8192) = 110 full steps


def test_tokens_before_is_the_prefix_sum_and_steps_for_its_inverse():
    ramp = BatchRamp(96, 96 * 5, 7_777)
    before = np.cumsum([0] + [ramp.tokens_in(k) for k in range(200)])
    assert [ramp.tokens_before(k) for k in range(201)] == before.tolist()
    for tokens in range(1, 20_000, 37):
        k = ramp.steps_for(tokens)
        assert ramp.tokens_before(k) >= tokens > (ramp.tokens_before(k - 1) if k else -1)


def _train_config(**overrides):
    from nanopt.config import TrainConfig

    return TrainConfig(**{"data": "d", "micro_batch_size": 1, "global_batch_tokens": 8192,
                          "batch_warmup_start_tokens": 1024, "batch_warmup_tokens": 100_000, "train_tokens": 10**6,
                          **overrides})


def test_budget_and_token_count_follow_the_ramp():
    from nanopt.config import ModelConfig, RunConfig

    model = ModelConfig(architecture="llama", vocab_size=64, **{**TINY_MODEL, "max_position_embeddings": 1024})
    assert _train_config().total_steps == 147  # 123 without the ramp
    run = RunConfig(run_dir=Path("r"), model=model, train=_train_config(train_tokens=None, max_steps=40))
    assert run.total_tokens == 102400 + 3 * 8192


def test_the_learning_rate_follows_tokens_under_the_ramp():
    from nanopt.train.optim.schedule import lr_at, scheduled_lr

    cfg = _train_config(warmup_steps=4, learning_rate=1e-3)
    # the warmup rises with the tokens: step 0 ends after 1,024 tokens (1/8 of a full step), step 14 after 16,384
    assert scheduled_lr(0, cfg.total_steps, cfg) == pytest.approx(1e-3 * 0.125 / 4)
    assert scheduled_lr(14, cfg.total_steps, cfg) == pytest.approx(1e-3 * 2 / 4)
    assert max(scheduled_lr(k, cfg.total_steps, cfg) for k in range(40)) == 1e-3  # never past the peak
    full = (cfg.total_steps - 37) + 102400 / 8192
    assert scheduled_lr(100, cfg.total_steps, cfg) == pytest.approx(lr_at((102400 + 64 * 8192) / 8192 - 1, full, cfg))
    assert scheduled_lr(cfg.total_steps - 1, cfg.total_steps, cfg) == pytest.approx(1e-4)  # the floor, at the end
    plain = _train_config(batch_warmup_tokens=None, batch_warmup_start_tokens=None, warmup_steps=4)
    assert scheduled_lr(14, 147, plain) == lr_at(14, 147, plain)  # without the ramp: by step, as always


def _samples(loader, steps):
    """Every step's samples (global indices, sorted) as the loader hands them out on one rank."""
    out = []
    for step in range(steps):
        first = loader.first_sample_of(step)
        seen = []
        for _ in range(loader.accum_at(step)):
            seen.extend(range(loader._first_sample(), loader._first_sample() + loader.micro_batch_size))
            loader.next_batch()
        assert min(seen) >= first and max(seen) < first + loader.samples_in(step)
        out.append(seen)
    return out


def test_the_loader_hands_out_each_steps_samples_once_on_any_world_size(tiny_dataset: Path):
    from nanopt.data.dataset import TokenDataset
    from nanopt.data.loaders.loader import TrainLoader

    ramp = BatchRamp(64, 256, 1000)  # seq_len 16: 4 sequences growing to 16
    dataset = TokenDataset.open(tiny_dataset)
    one = TrainLoader(dataset, "train", 16, 2, 8, 0, 1, seed=3, batch_ramp=ramp)
    assert [one.accum_at(k) for k in range(12)] == [2] * 6 + [4] * 3 + [6] * 2 + [8]
    single = _samples(one, 12)
    ranks = [_samples(TrainLoader(dataset, "train", 16, 1, 4, rank, 4, seed=3, batch_ramp=ramp), 12)
             for rank in range(4)]
    for step, samples in enumerate(single):
        together = sorted(s for rank in ranks for s in rank[step])
        assert sorted(samples) == together == list(range(one.first_sample_of(step), one.first_sample_of(step + 1)))


# seq_len 16. The batch grows 32 -> 64 -> 96 -> 128 tokens (2 to 8 sequences) over 512 tokens: steps 0-5 at 32,
# 6-8 at 64, 9-10 at 96, then 128. Micro-batch 2 is one micro-batch of the first step on one rank; two ranks must
# lower it to 1 (nanopt.train.parallel.world_fit), which a resume on another world size does by itself.
RAMP = {"micro_batch_size": 2, "global_batch_tokens": 128, "batch_warmup_start_tokens": 32,
        "batch_warmup_tokens": 512, "max_steps": 14, "checkpoint_interval": 4, "eval_interval": 0,
        "warmup_steps": 2, "log_interval": 1}


@pytest.mark.slow
def test_a_run_killed_before_the_ramp_boundaries_resumes_exactly_on_one_or_two_ranks(tmp_path: Path,
                                                                                   tiny_dataset: Path,
                                                                                   launcher: Launcher):
    whole = make_run(tmp_path, tiny_dataset, "whole", model=TINY_MODEL, **RAMP)
    launcher.train(whole)
    expected = losses(whole)
    tokens = [json.loads(line)["tokens"] for line in (whole / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "train"]
    assert tokens[:12] == [32, 64, 96, 128, 160, 192, 256, 320, 384, 480, 576, 704]

    for name, args in (("one", ()), ("two", ("--nproc-per-node", "2"))):
        run = make_run(tmp_path, tiny_dataset, name, model=TINY_MODEL, **RAMP)
        killed = launcher.start("train", run, "--no-live", kill_at_step={
            "step": 7, "checkpoints": str(run / "checkpoints"), "latest": "step-000004"})
        assert launcher.wait(killed) != 0 and ckpt.resolve(run, "latest").step == 4  # SIGKILLed in step 7
        resumed = launcher.train(run, *args)  # resumes at step 4, before the boundaries at steps 6, 9 and 11
        lowered = "micro_batch_size 2 does not divide the batch warmup's first batch of 32 tokens on 2 rank(s)"
        assert (lowered in resumed.stderr + resumed.stdout) == bool(args)
        got = losses(run)
        assert ckpt.resolve(run, "latest").meta["world_size"] == (2 if args else 1)
        if args:  # two ranks sum the same samples in another order
            assert got == pytest.approx(expected, rel=1e-5), name
        else:
            assert got == expected, name


@pytest.mark.parametrize("change, words", [
    ({"batch_warmup_start_tokens": 48}, ("batch_warmup_start_tokens", "48", "whole number of micro-batches")),
    ({"batch_warmup_start_tokens": 128}, ("batch_warmup_start_tokens", "smaller")),
    ({"batch_warmup_start_tokens": None}, ("needs both",)),
    ({"batch_warmup_tokens": 0}, ("batch_warmup_tokens", "positive")),
])
def test_a_bad_ramp_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process, change, words):
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **{**RAMP, "batch_warmup_start_tokens": 64, **change})
    assert_user_error(cli_in_process("train", run), *words)
    assert not (run / "checkpoints").exists()


def test_a_ramp_not_whole_micro_batches_per_rank_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **RAMP)  # a fresh run: the person chooses
    result = cli_in_process("train", run, "--nproc-per-node", "2")
    assert_user_error(result, "batch_warmup_start_tokens", "32", "micro_batch_size x seq_len x world_size")


def test_a_ramp_with_a_mixture_is_one_line(tmp_path: Path, mixture_sources: dict[str, Path], cli_in_process):
    run = make_run(tmp_path, mixture_sources["web"], model=TINY_MODEL, **{**RAMP, "data": mixture(mixture_sources)})
    assert_user_error(cli_in_process("train", run), "batch_warmup_tokens", "mixture")


def _ramp_run(tmp_path: Path, tiny_dataset: Path, **train):
    from nanopt.config import load_run

    return load_run(make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **{**RAMP, **train}))


def test_estimate_counts_the_ramps_steps_and_tokens(tmp_path: Path, tiny_dataset: Path):
    from nanopt.plan.estimate import EstimateOptions, estimate

    run = _ramp_run(tmp_path, tiny_dataset, max_steps=None, train_tokens=1280)
    report = estimate(run, EstimateOptions())
    # 576 tokens in the ramp's 11 steps, then ceil(704 / 128) = 6 full ones: 17 steps (10 without the ramp)
    assert report["optimizer_steps"] == 17 and report["train_tokens"] == 576 + 6 * 128
    assert report["batch_warmup"] == {"start_tokens": 32, "tokens": 576, "steps": 11}


def test_the_projection_counts_ramp_steps_by_their_tokens(tmp_path: Path, tiny_dataset: Path):
    from nanopt.train.observe.phases import projected_seconds
    from nanopt.train.shape_schedule import step_times

    run = _ramp_run(tmp_path, tiny_dataset)  # 14 steps: 576 tokens in 11 ramp steps, then 3 x 128
    assert projected_seconds(run, 0, 2.0, None, None)["train"] == pytest.approx((576 + 3 * 128) / 128 * 2.0)
    assert projected_seconds(run, 11, 2.0, None, None)["train"] == pytest.approx(3 * 2.0)
    # four steps of 32 tokens in 1 s: 0.25 s a step, 1 s a full step of 128
    assert step_times(run.train, 1.0, 0, 128) == (0.25, 1.0)


def test_find_batch_tries_only_sizes_that_divide_the_ramps_first_batch(tmp_path: Path, tiny_dataset: Path):
    from nanopt.plan.find_batch.search import grad_accum_for, trial_run, usable_micro_batches

    run = _ramp_run(tmp_path, tiny_dataset, micro_batch_size=1, global_batch_tokens=16 * 12,
                    batch_warmup_start_tokens=16 * 4)
    assert usable_micro_batches(run.train, 16, 1, 64) == [1, 2, 4]  # 12 sequences alone would allow 3, 6, 12
    assert grad_accum_for(run.train, 2, 16, 1) == 6 and grad_accum_for(run.train, 3, 16, 1) is None
    assert trial_run(run, 8, 1).train.batch_ramp is None  # a trial is one micro-batch a step, no ramp


def test_preflight_times_full_size_steps(tmp_path: Path, tiny_dataset: Path):
    from nanopt.runtime import init_runtime
    from nanopt.train.session import build_session
    from nanopt.train.shape_schedule import skip_the_ramp

    run = _ramp_run(tmp_path, tiny_dataset)
    session = build_session(run, init_runtime("fp32"), writes=False)
    skip_the_ramp(session)
    assert (session.state.step, session.state.tokens) == (11, 576)
    assert session.loader.accum_at(session.state.step) == 4 and session.loader._first_sample() == 576 // 16


@pytest.mark.slow
def test_a_rollback_during_the_ramp_skips_data_by_its_batches_and_counts_the_tokens_read(tmp_path: Path,
                                                                                        tiny_dataset: Path,
                                                                                        launcher: Launcher):
    # 2 sequences a step growing to 16 over 4,000 tokens: 47 ramp steps (18 of 32 tokens, 9 of 64, 6 of 96, ...).
    # 30 healthy steps, then a learning rate of 10 spikes; the rollback to step 30 moves the data 10 steps past
    # the spike, so the steps after it read the batches of later, larger ramp steps than their own numbers.
    ramp = {"micro_batch_size": 1, "global_batch_tokens": 256, "batch_warmup_start_tokens": 32,
            "batch_warmup_tokens": 4000, "max_steps": 30, "checkpoint_interval": 5, "eval_interval": 0,
            "warmup_steps": 3, "log_interval": 1}
    run = make_run(tmp_path, tiny_dataset, model=TINY_MODEL, **ramp)
    launcher.train(run)
    result = launcher.train(run, "--set", "max_steps=40", "--set", "learning_rate=10", "--set",
                            "recovery_lr_factor=0.0003", "--set", "recovery_lr_steps=1000000", "--allow-changed")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    [event] = [r for r in records if r.get("event") == "recovery"]
    assert event["to_step"] == 30, result.stderr[-3000:]
    curve = BatchRamp(32, 256, 4000)
    data_step = event["step"] + 10  # recovery_skip_steps
    assert event["skipped_samples"] == (curve.tokens_before(data_step) - curve.tokens_before(30)) // 16
    final = [r for r in records if r["kind"] == "train" and r["step"] == 40][-1]
    read_after = curve.tokens_before(data_step + 10) - curve.tokens_before(data_step)  # steps 31-40's batches
    assert final["tokens"] == curve.tokens_before(30) + read_after
    assert ckpt.resolve(run, "latest").step == 40


def test_the_ramp_cannot_change_on_resume_even_when_asked():
    """Every step's samples follow from the ramp: changed, a checkpoint's step would point at other data."""
    from nanopt.config import ModelConfig, RunConfig, TrainConfig
    from nanopt.errors import ResumeError
    from nanopt.train.checkpoint.resume import check_resumable

    model = ModelConfig(**{"architecture": "llama", "vocab_size": 64, **TINY_MODEL})
    saved = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(data="d", **RAMP)).snapshot()
    meta = {"config": saved, "world_size": 1, "data_fingerprint": "f"}
    for key, value in (("batch_warmup_tokens", 1024), ("batch_warmup_start_tokens", 64)):
        changed = RunConfig(run_dir=Path("r"), model=model, train=TrainConfig(data="d", **{**RAMP, key: value}))
        with pytest.raises(ResumeError, match=f"cannot resume.*{key}"):
            check_resumable(meta, changed, "f", allow_changed=True, world_size=1)
