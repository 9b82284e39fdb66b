"""Data mixtures (train.json `data` with several datasets and weights, `data_phases`): the shares the loader reads,
epochs per source, phase changes, exact resume after SIGKILL and on another world size, per-source validation and
test loss, and what estimate and tokenize plan (the one-line errors of a bad mixture: test_mixture_errors.py)."""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from faulthelp import Launcher, tiny_run
from mixturehelp import WEIGHTS, mixture
from trainhelp import eval_losses, losses, make_run

from nanopt.config import load_run
from nanopt.data.mixtures.mixture import MixtureLoader, open_run_data
from nanopt.train import checkpoint as ckpt
from nanopt.train.optim.schedule import lr_at

# Stated tolerance: in every window of 100 consecutive steps (and over the run) each source's share of the samples
# is within half a percentage point of its weight. The interleave's bound is 2 samples in any window of samples
# (nanopt.data.mixtures.interleave): 0.125% of the 1,600 samples of 100 steps here, and it is tested on short windows
# too.
SHARE_TOLERANCE = 0.005
SAMPLE_TOLERANCE = 2


@pytest.fixture
def sources(mixture_sources: dict[str, Path]) -> dict[str, Path]:
    return mixture_sources


def loader_for(run: Path, rank: int, world_size: int, grad_accum: int) -> MixtureLoader:
    config = load_run(run)
    return MixtureLoader(open_run_data(config), "train", config.seq_len, config.train.micro_batch_size, grad_accum,
                         rank, world_size, config.train.seed)


class WindowIndex:
    """Which (source, window) a batch row is, found by its tokens: the test reads what the loader hands out."""

    def __init__(self, sources: dict[str, Path], seq_len: int) -> None:
        from nanopt.data.dataset import TokenDataset

        self.where: dict[bytes, tuple[str, int]] = {}
        self.windows: dict[str, int] = {}
        for name in WEIGHTS:
            stream = TokenDataset.open(sources[name]).stream("train")
            count = (stream.total - 1) // seq_len
            rows = stream.windows(np.arange(count, dtype=np.int64) * seq_len, seq_len + 1)
            self.windows[name] = count
            for window, row in enumerate(rows):
                self.where.setdefault(row.tobytes(), (name, window))

    def rows(self, inputs, targets) -> list[tuple[str, int]]:
        whole = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
        return [self.where[row.tobytes()] for row in whole]


def read_steps(loaders: list[MixtureLoader], steps: int, index: WindowIndex) -> list[list[tuple[str, int]]]:
    """Each step's samples in global order (micro-step, then rank), as every rank's loader hands them out."""
    out = []
    for _ in range(steps):
        samples = []
        for _ in range(loaders[0].grad_accum):
            for loader in loaders:
                samples += index.rows(*loader.next_batch())
        out.append(samples)
    return out


def test_every_window_of_100_steps_holds_each_source_at_its_weight_and_no_window_repeats_within_an_epoch(
        tmp_path: Path, sources: dict[str, Path]):
    # 2 ranks x micro-batch 4 x accumulation 2: 16 samples a step, 4,800 in 300 steps; code (947 windows) and math
    # (444) are read into their second epoch.
    run = make_run(tmp_path, sources["web"], data=mixture(sources), max_steps=300, global_batch_tokens=16 * 32)
    index = WindowIndex(sources, 32)
    steps = read_steps([loader_for(run, rank, 2, 2) for rank in range(2)], 300, index)
    for first in range(0, 300 - 100 + 1):
        window = [name for step in steps[first:first + 100] for name, _ in step]
        for name, weight in WEIGHTS.items():
            assert abs(window.count(name) / len(window) - weight) <= SHARE_TOLERANCE, (first, name)
    read = [sample for step in steps for sample in step]
    for name, weight in WEIGHTS.items():
        assert abs(sum(1 for source, _ in read if source == name) / len(read) - weight) <= SHARE_TOLERANCE
        before = np.concatenate([[0], np.cumsum([source == name for source, _ in read])])
        for length in range(1, 49):  # every run of 1 to 48 consecutive samples, wherever it starts
            assert np.abs(before[length:] - before[:-length] - length * weight).max() < SAMPLE_TOLERANCE, length
    assert_each_epoch_reads_each_window_once(read, index)
    math = [window for source, window in read if source == "math"]
    assert len(math) > index.windows["math"]  # math did start its second epoch, in a new order
    assert math[index.windows["math"]:] != math[:len(math) - index.windows["math"]]


def reads_on_this_rank(run: Path, sources: dict[str, Path], steps: int) -> list[list[tuple[str, int]]]:
    """On a gloo rank: what this rank's loader hands out over `steps` steps, gathered from every rank (rank, then
    micro-step) into each step's samples in global order."""
    import torch.distributed as dist

    from nanopt.runtime import ranks

    place = ranks()
    dist.init_process_group("gloo")
    try:
        loader = loader_for(run, place.rank, place.world_size, 2)
        index = WindowIndex(sources, 32)
        mine = [[index.rows(*loader.next_batch()) for _ in range(2)] for _ in range(steps)]
        everyone: list = [None] * place.world_size
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    return [[sample for micro in range(2) for rank in everyone for sample in rank[step][micro]]
            for step in range(steps)]


@pytest.mark.slow  # two ranks that import torch and read 300 steps each: ~15 s of CPU
def test_two_gloo_ranks_read_disjoint_samples_at_the_weights(tmp_path: Path, sources: dict[str, Path]):
    from distributed import run_ranks
    from trainhelp import HIDE_CUDA

    run = make_run(tmp_path, sources["web"], data=mixture(sources), max_steps=300, global_batch_tokens=16 * 32)
    rank0, rank1 = run_ranks(reads_on_this_rank, run, sources, 300, env=HIDE_CUDA)
    assert rank0 == rank1
    read = [sample for step in rank0 for sample in step]
    for first in range(0, 300 - 100 + 1):
        window = [name for step in rank0[first:first + 100] for name, _ in step]
        for name, weight in WEIGHTS.items():
            assert abs(window.count(name) / len(window) - weight) <= SHARE_TOLERANCE, (first, name)
    assert_each_epoch_reads_each_window_once(read, WindowIndex(sources, 32))
    one_process = read_steps([loader_for(run, 0, 1, 4)], 300, WindowIndex(sources, 32))
    assert rank0 == one_process  # and the same samples, step by step, as one process with 4 micro-steps


def assert_each_epoch_reads_each_window_once(read: list[tuple[str, int]], index: WindowIndex) -> None:
    for name, size in index.windows.items():
        order = [window for source, window in read if source == name]
        for start in range(0, len(order), size):  # each epoch of the source reads each window at most once ...
            epoch = order[start:start + size]
            assert len(set(epoch)) == len(epoch), (name, start // size)
            if len(epoch) == size:  # ... and a whole epoch reads every window
                assert sorted(epoch) == list(range(size))


def test_reading_ahead_hands_out_the_same_batches(tmp_path: Path, sources: dict[str, Path]):
    run = make_run(tmp_path, sources["web"], data=mixture(sources), data_phases=[{"from": 5, "mixture": {"math": 1}}],
                   max_steps=12, global_batch_tokens=16 * 32)
    plain, ahead = loader_for(run, 1, 2, 2), loader_for(run, 1, 2, 2)
    ahead.prefetch()  # the next micro-batch read in a background thread (on a GPU, into pinned memory)
    try:
        for _ in range(12 * 2):
            assert all((a == b).all() for a, b in zip(plain.next_batch(), ahead.next_batch(), strict=True))
    finally:
        ahead.close()
    assert ahead.state_dict() == plain.state_dict()


def test_a_token_id_past_the_vocabulary_in_one_source_is_a_data_error_naming_its_shard(tmp_path: Path,
                                                                                      sources: dict[str, Path]):
    from nanopt.errors import DataError

    bad = tmp_path / "math"
    shutil.copytree(sources["math"], bad)
    shard = sorted((bad / "train").glob("*.npy"))[-1]
    tokens = np.load(shard, mmap_mode="r+")
    tokens[:] = 600  # past the vocabulary of 512; meta.json's checksums are not checked below (as for a large set)
    tokens.flush()
    del tokens
    run = make_run(tmp_path, sources["web"], data=mixture({**sources, "math": bad}), global_batch_tokens=16 * 32)
    config = load_run(run)
    data = open_run_data(config, verify_up_to_bytes=0)
    with pytest.raises(DataError) as raised:
        MixtureLoader(data, "train", 32, 4, 4, 0, 1, 7)
    assert "token id 600 at step 1" in raised.value.message and str(shard) in raised.value.message


def test_resume_on_another_world_size_reads_the_same_samples(tmp_path: Path, sources: dict[str, Path]):
    phases = [{"from": 30, "mixture": {"math": 1, "code": 3}}]
    run = make_run(tmp_path, sources["web"], data=mixture(sources), data_phases=phases, max_steps=80,
                   global_batch_tokens=16 * 32)
    index = WindowIndex(sources, 32)
    straight = read_steps([loader_for(run, 0, 1, 4)], 60, index)
    two = [loader_for(run, rank, 2, 2) for rank in range(2)]
    first = read_steps(two, 23, index)
    state = json.loads(json.dumps(two[0].state_dict()))  # through JSON, as meta.json carries it
    four = [loader_for(run, rank, 4, 1) for rank in range(4)]
    for loader in four:
        loader.load_state_dict(state)
    assert first + read_steps(four, 37, index) == straight
    assert_each_epoch_reads_each_window_once([sample for step in straight for sample in step], index)


def test_a_resume_refuses_a_mixture_changed_before_its_step_and_takes_a_later_phase(tmp_path: Path,
                                                                                    sources: dict[str, Path]):
    from nanopt.errors import ResumeError

    def loader(name: str, weights: dict[str, float], phases: list | None = None) -> MixtureLoader:
        run = make_run(tmp_path, sources["web"], name, data=mixture(sources, weights), data_phases=phases,
                       max_steps=80, global_batch_tokens=16 * 32)
        return loader_for(run, 0, 1, 4)

    saved = loader("saved", WEIGHTS)
    for _ in range(10 * 4):
        saved.next_batch()
    state = json.loads(json.dumps(saved.state_dict()))
    with pytest.raises(ResumeError, match="phases up to step 10 changed"):
        loader("reweighted", {"web": 0.6, "code": 0.3, "math": 0.1}).load_state_dict(state)
    with pytest.raises(ResumeError, match="sources were"):
        loader("fewer", {"web": 0.7, "code": 0.3}).load_state_dict(state)
    later = loader("later", WEIGHTS, [{"from": 20, "mixture": {"math": 1}}])
    later.load_state_dict(state)  # a phase that starts after the checkpoint may be added
    assert later.step == 10


def test_a_phase_starts_at_its_step_and_decay_ties_it_to_the_wsd_decay(tmp_path: Path, sources: dict[str, Path]):
    phases = [{"from": "decay", "mixture": {"web": 1, "math": 1}}]
    run = make_run(tmp_path, sources["web"], data=mixture(sources), data_phases=phases, max_steps=40,
                   lr_schedule="wsd", decay_fraction=0.25, global_batch_tokens=16 * 32)
    config = load_run(run)
    peak = config.train.learning_rate
    # The decay's first step is the last at the peak: the linear decay starts from it (schedule.lr_at).
    decay = next(step for step in range(40) if step >= config.train.warmup_steps
                 and lr_at(step, 40, config.train) < peak) - 1
    assert decay == 29
    index = WindowIndex(sources, 32)
    steps = read_steps([loader_for(run, 0, 1, 4)], 40, index)
    with_code = [step for step, samples in enumerate(steps) if any(name == "code" for name, _ in samples)]
    assert with_code == list(range(decay))  # code is in every step of the first phase, in none from the decay on
    after = [name for samples in steps[decay:] for name, _ in samples]
    assert after.count("web") == after.count("math")


def test_per_source_validation_losses_average_to_val_loss(tmp_path: Path, sources: dict[str, Path],
                                                          launcher: Launcher):
    # 4 steps of 4 samples of 16 tokens: math gives 2 of its 889 windows, 0.0022 epochs, over a warning at 0.002.
    run = tiny_run(tmp_path, sources["web"], "run", data=mixture(sources), max_steps=4, eval_interval=2,
                   data_epochs_warning=0.002)
    trained = launcher.train(run, "--json")
    summary = json.loads(trained.stdout)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "source math: 32 tokens over the run, 0.00 epochs of its train split" in trained.stderr
    assert "sources read more than data_epochs_warning = 0.002 times: math 0.00 epochs" in trained.stderr
    repeats = [r for r in records if r.get("event") == "source_repeats"]
    assert [sorted(r["epochs"]) for r in repeats] == [["math"]]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        parts = record["sources"]
        assert sorted(parts) == sorted(WEIGHTS)
        tokens = sum(part["val_tokens"] for part in parts.values())
        mean = sum(part["val_loss"] * part["val_tokens"] for part in parts.values()) / tokens
        assert record["val_tokens"] == tokens and record["val_loss"] == pytest.approx(mean, rel=1e-12)
        assert len({part["val_loss"] for part in parts.values()}) == 3  # each scored on its own split
    trains = [r for r in records if r["kind"] == "train"]
    assert sum(part["tokens"] for part in trains[-1]["sources"].values()) == trains[-1]["tokens"]
    assert summary["sources"]["math"]["val_loss"] == evals[-1]["sources"]["math"]["val_loss"]
    assert summary["sources"]["web"]["weight"] == pytest.approx(0.7)
    evaluated = launcher.run("eval", run, "--no-samples", "--tokens", "all", "--json")
    assert evaluated.status == 0, evaluated.stderr
    result = json.loads((run / "eval.json").read_text())
    parts = result["sources"]
    assert {name: part["dataset"] for name, part in parts.items()} == {name: str(sources[name]) for name in WEIGHTS}
    tokens = sum(part["tokens"] for part in parts.values())
    assert result["tokens"] == tokens == sum(json.loads((sources[name] / "meta.json").read_text())["splits"]["test"]
                                             ["tokens"] - 1 for name in WEIGHTS)  # every source's whole test split
    mean = sum(part["test_loss"] * part["tokens"] for part in parts.values()) / tokens
    assert result["test_loss"] == pytest.approx(mean, rel=1e-12)


def _source_tokens(run: Path) -> dict[int, dict[str, int]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {name: part["tokens"] for name, part in r["sources"].items()}
            for r in records if r["kind"] == "train"}


def _kill_at(launcher: Launcher, run: Path, step: int) -> None:
    """SIGKILL the run as it reads step `step`, once the checkpoint before it (every 2 steps) is published."""
    saved = f"step-{(step - 1) // 2 * 2:06d}"
    child = launcher.start("train", run, "--no-live", kill_at_step={
        "step": step, "checkpoints": str(run / "checkpoints"), "latest": saved})
    assert launcher.wait(child) == -signal.SIGKILL, "the run ended before it could be killed"


@pytest.mark.slow
def test_sigkills_and_a_resume_on_two_ranks_give_the_uninterrupted_run(tmp_path: Path, sources: dict[str, Path],
                                                                      launcher: Launcher):
    """Killed twice at random steps and resumed on 1 process: the same losses bit for bit, the same tokens per
    source; resumed instead on 2 gloo ranks: the same tokens per source and the same losses up to summation order.
    The phase starts at step 20 in all of them."""
    train = {"data": mixture(sources), "data_phases": [{"from": 0.5, "mixture": {"web": 1, "math": 1}}],
             "eval_interval": 10}
    straight, killed = (tiny_run(tmp_path, sources["web"], name, **train) for name in ("straight", "killed"))
    launcher.train(straight)
    chance = random.Random()
    first = chance.randint(5, 19)
    second = chance.randint(first + 3, 37)
    _kill_at(launcher, killed, first)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(killed, elsewhere)
    _kill_at(launcher, killed, second)
    launcher.train(killed)
    a, b = losses(straight), losses(killed)
    assert a == b, (first, second)
    assert eval_losses(straight) == eval_losses(killed)
    tokens = _source_tokens(straight)
    assert _source_tokens(killed) == tokens
    # 4 samples of 16 tokens a step; 7:2:1 until step 20 (80 samples, 16 of code), then web and math alone.
    assert {step: tokens[step]["code"] for step in range(20, 41)} == dict.fromkeys(range(20, 41), 16 * 16)
    assert tokens[40]["web"] - tokens[20]["web"] == tokens[40]["math"] - tokens[20]["math"] == 40 * 16
    launcher.train(elsewhere, "--nproc-per-node", "2")
    assert _source_tokens(elsewhere) == tokens
    c = losses(elsewhere)
    assert sorted(c) == sorted(a) and max(abs(a[s] - c[s]) for s in a) <= 1e-5, (first, a, c)
    assert ckpt.read_pointer(elsewhere / "checkpoints", "latest") == "step-000040"


def test_estimate_shows_what_each_source_gives_and_flags_one_too_small(tmp_path: Path, sources: dict[str, Path],
                                                                       cli_in_process):
    # 2,000 steps of 256 tokens: math (10%, 14k train tokens) is read 3.6 times, over the warning set at 3.5; web and
    # code ~3.3 times, short but under it.
    run = make_run(tmp_path, sources["web"], data=mixture(sources), max_steps=2000, data_epochs_warning=3.5)
    result = cli_in_process("estimate", run, "--json")
    assert result.returncode == 0, result.stderr
    plans = {plan["name"]: plan for plan in json.loads(result.stdout)["sources"]}
    assert sum(plan["run_tokens"] for plan in plans.values()) == 2000 * 256
    for name, weight in WEIGHTS.items():
        assert plans[name]["run_tokens"] == round(weight * 2000 * 256)
        split = json.loads((sources[name] / "meta.json").read_text())["splits"]["train"]["tokens"]
        assert plans[name]["epochs"] == pytest.approx(plans[name]["run_tokens"] / ((split - 1) // 32 * 32))
    assert [name for name, plan in plans.items() if plan["too_small"]] == ["math"]
    assert [name for name, plan in plans.items() if plan["short"]] == ["web", "code", "math"]
    shown = cli_in_process("estimate", run)
    assert "source math would be read 3.60 times (data_epochs_warning 3.5)" in " ".join(shown.stdout.split())


def test_chinchilla_for_one_source_of_a_mixture_is_its_share(tmp_path: Path, sources: dict[str, Path]):
    from nanopt.data.budget import chinchilla_train_tokens

    run = make_run(tmp_path, sources["web"], data=mixture(sources))
    whole = chinchilla_train_tokens(run)
    shares = {name: chinchilla_train_tokens(run, sources[name]) for name in WEIGHTS}
    for name, weight in WEIGHTS.items():  # one pass over its samples: its share of the windows, plus one token
        assert shares[name] - 1 == pytest.approx(weight * (whole - 1), abs=32)
    assert chinchilla_train_tokens(run, tmp_path / "elsewhere") == whole
