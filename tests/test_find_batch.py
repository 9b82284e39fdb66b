"""`nanopt find-batch`: the search over sizes, ranks agreeing through a real gloo all-reduce, CPU memory bounds
on a run whose activations grow with the micro-batch, and --write.

Single-process commands run in this process (`cli_on_cpu`: through the launcher, CUDA hidden, on a GPU host; each
trial still gets a process of its own unless --isolation in-process). The two-rank search goes through
`--nproc-per-node 2` on purpose: it is the one command whose options (--start, --max) torchrun's own parser would
take for its own if the launcher passed them on wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from clihelp import assert_user_error
from distributed import run_ranks
from faulthelp import Launcher, tiny_run
from trainhelp import make_run

from nanopt.plan.find_batch.search import agree, search
from nanopt.runtime import Runtime

# ------------------------------------------------------------------------------------------------ search


@pytest.mark.parametrize(("threshold", "start", "maximum"), [
    (37, 1, 1024),  # not a power of two: doubling overshoots to 64, bisection comes back
    (64, 1, 1024),  # exactly a power of two
    (1, 1, 1024),  # only the smallest fits
    (100, 1, 100),  # a maximum that is not a power of two, everything fits
    (5000, 1, 1024),  # everything fits up to --max
    (37, 3, 1024),  # --start: 3, 6, 12, 24, 48, then bisection
    (2, 8, 1024),  # --start itself fails: bisect below it
    (999, 1, 1000),
])
def test_search_finds_the_largest_size_that_fits(threshold: int, start: int, maximum: int):
    calls: list[int] = []

    def fits(size: int) -> bool:
        calls.append(size)
        return size <= threshold

    found, tried = search(fits, start, maximum)
    assert found == min(threshold, maximum)
    assert tried == calls and len(set(tried)) == len(tried)  # each size once, in the order reported
    assert all(1 <= size <= maximum for size in tried)
    assert len(tried) <= 2 * maximum.bit_length() + 1  # logarithmic, not a scan


def test_search_when_nothing_fits():
    found, tried = search(lambda size: False, 1, 1024)
    assert (found, tried) == (0, [1])
    found, tried = search(lambda size: False, 4, 1024)
    assert found == 0 and tried == [4, 2, 1]


def test_search_doubles_then_bisects():
    _, tried = search(lambda size: size <= 37, 1, 1024)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_search_rejects_an_empty_range():
    with pytest.raises(ValueError):
        search(lambda size: True, 10, 5)


# ------------------------------------------------------------------------------------------ rank agreement


def _agree_in_rank() -> dict:
    import torch.distributed as dist

    from nanopt.runtime import ranks

    rank = ranks().rank
    dist.init_process_group("gloo")  # torchrun's environment: MASTER_ADDR / MASTER_PORT, RANK, WORLD_SIZE
    rt = Runtime(device=torch.device("cpu"), rank=rank, local_rank=rank, world_size=2, precision="fp32")
    # Rank 0 and rank 1 see different local outcomes; both must come away with the same answer.
    pairs = [(True, False), (False, True), (True, True), (False, False)]
    answers = [agree(rt, pair[rank]) for pair in pairs]
    # A whole search where rank 1 has less memory (fits up to 20) than rank 0 (up to 37).
    limit = 37 if rank == 0 else 20
    found, tried = search(lambda size: agree(rt, size <= limit), 1, 1024)
    dist.destroy_process_group()
    return {"answers": answers, "found": found, "tried": tried}


def test_two_gloo_ranks_agree_on_the_minimum_and_bisect_identically():
    rank0, rank1 = run_ranks(_agree_in_rank)
    assert rank0["answers"] == rank1["answers"] == [False, False, True, False]
    assert rank0["found"] == rank1["found"] == 20
    assert rank0["tried"] == rank1["tried"]


# ------------------------------------------------------------------------------------------- on a real run

# Large enough that activations clearly grow with the micro-batch (about 10 MiB per sequence on the CPU).
GROWING_MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 256}


def find_batch_json(cli, run: Path, *args: str) -> dict:
    """`nanopt find-batch RUN --json --margin 0 ARGS` through `cli` (in this process, or a launcher's `run`); a
    trial that hangs ends at --timeout instead of holding up the test."""
    result = cli("find-batch", run, "--json", "--margin", "0", "--timeout", "300", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture
def cli_on_cpu(request: pytest.FixtureRequest):
    """`nanopt find-batch` on the CPU: in this process where there is no GPU; on a CUDA host through the warm
    launcher, whose commands see no GPU (this process cannot hide CUDA once torch has looked for it)."""
    if torch.cuda.is_available():
        return request.getfixturevalue("launcher").run
    return request.getfixturevalue("cli_in_process")


def test_cpu_without_a_bound_is_a_user_error(tmp_path: Path, tiny_dataset: Path, cli_on_cpu):
    run = make_run(tmp_path, tiny_dataset)
    assert_user_error(cli_on_cpu("find-batch", run), "on the CPU", "--max-memory")


@pytest.mark.slow
def test_a_smaller_bound_finds_a_smaller_batch_and_write_updates_train_json(tmp_path: Path, tiny_dataset: Path,
                                                                           cli_on_cpu,
                                                                           capsys: pytest.CaptureFixture,
                                                                           monkeypatch: pytest.MonkeyPatch):
    run = make_run(tmp_path, tiny_dataset, model=GROWING_MODEL, micro_batch_size=2, global_batch_tokens=16 * 256)
    before = json.loads((run / "train.json").read_text())

    roomy = find_batch_json(cli_on_cpu, run, "--max-memory", "4GiB", "--start", "4", "--max", "8")
    assert roomy["max_micro_batch"] == 8 and roomy["max_micro_batch_capped"]
    assert roomy["search_order"] == [4, 8]
    peaks = {t["micro_batch_size"]: t["peak_memory_bytes"] for t in roomy["trials"]}
    assert all(t["fits"] and t["reason"] == "fits" and t["tokens_per_s"] > 0 for t in roomy["trials"])
    assert peaks[8] - peaks[4] > 16 * 2**20, peaks  # the set-up itself: memory must grow with the batch
    assert json.loads((run / "find_batch.json").read_text())["trials"] == roomy["trials"]

    # A bound between the peaks of 4 and 8 sequences: 4 must fit, 8 must not.
    bound = (peaks[4] + peaks[8]) // 2
    tight = find_batch_json(cli_on_cpu, run, "--max-memory", str(bound), "--start", "4", "--max", "8", "--write")
    assert 4 <= tight["max_micro_batch"] < roomy["max_micro_batch"]
    assert not tight["max_micro_batch_capped"]
    by_size = {t["micro_batch_size"]: t for t in tight["trials"]}
    assert by_size[8]["reason"] == "over limit" and not by_size[8]["fits"]
    assert all(t["fits"] == (t["micro_batch_size"] <= tight["max_micro_batch"]) for t in tight["trials"])
    assert tight["limit"]["usable_bytes"] == bound

    # Only 4 of the sizes that fit divides the global batch of 16 x 256 tokens exactly.
    assert tight["best_micro_batch"] == 4 and tight["grad_accum_at_best"] == 4
    assert tight["written"] == {"path": str(run / "train.json"), "old": 2, "new": 4}
    after = json.loads((run / "train.json").read_text())
    assert after["micro_batch_size"] == 4
    assert list(after) == list(before)
    assert {k: v for k, v in after.items() if k != "micro_batch_size"} == \
        {k: v for k, v in before.items() if k != "micro_batch_size"}

    calibration = tight["calibration"]
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "peak_error", "predicted_max_micro_batch",
                "max_micro_batch_error"):
        assert calibration[key] is not None, key
    assert tight["predicted_max_micro_batch"] == calibration["predicted_max_micro_batch"]
    assert calibration["peak_error"] == pytest.approx(
        calibration["predicted_peak_bytes"] / calibration["measured_peak_bytes"] - 1)

    from nanopt.cli.commands.find_batch import render

    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    render(tight)
    table = capsys.readouterr().out
    for fragment in ("over limit", "largest with exact accumulation", "memory model: peak"):
        assert fragment in table
    assert "inexact" not in table  # only sizes that divide the global batch were tried


@pytest.mark.slow
def test_two_ranks_under_torchrun_search_together(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    # The global batch of 256 tokens is 4 sequences of 32 on each of 2 ranks: micro-batches 2 and 4 both divide it.
    run = make_run(tmp_path, tiny_dataset, micro_batch_size=2, global_batch_tokens=4 * 32 * 2)
    report = find_batch_json(launcher.run, run, "--nproc-per-node", "2", "--max-memory", "4GiB", "--start", "2",
                             "--max", "4")
    assert report["world_size"] == 2
    assert report["max_micro_batch"] == 4 and report["search_order"] == [2, 4]
    assert all(t["fits"] and t["peak_memory_bytes"] > 0 for t in report["trials"])
    assert [t["grad_accum"] for t in report["trials"]] == [2, 1]
    assert report["best_micro_batch"] in (2, 4)  # the faster of the two, as both ranks measured them together


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_cap_finds_a_smaller_batch(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    """bf16 with compile, as a GPU run is by default: a fresh process per trial."""
    run = make_run(tmp_path, tiny_dataset, model={**GROWING_MODEL, "hidden_size": 512, "num_hidden_layers": 4},
                   micro_batch_size=2, global_batch_tokens=1024 * 256, precision="auto", compile="auto")
    large = find_batch_json(gpu_cli(launcher), run, "--gpu-memory", "6GiB", "--max", "256")
    small = find_batch_json(gpu_cli(launcher), run, "--gpu-memory", "3GiB", "--max", "256")
    assert large["isolation"] == small["isolation"] == "process" and large["compiled"]
    assert 0 < small["max_micro_batch"] < large["max_micro_batch"]
    assert any(t["reason"] in ("OOM", "over limit") for t in small["trials"])
    assert small["calibration"]["peak_error"] is not None
    assert small["predicted_micro_batch"] is not None and small["search_start_source"] == "memory model"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_search_in_process_goes_on_after_a_real_oom(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    """Eager bf16 on one GPU: every trial in the command's own process. 512 sequences of this model need several
    GiB, so under a 3 GiB cap the first trial raises a real CUDA OOM; its memory is freed and the search goes on
    in the same process to the largest size that fits."""
    run = make_run(tmp_path, tiny_dataset, model={**GROWING_MODEL, "hidden_size": 512, "num_hidden_layers": 4},
                   micro_batch_size=2, global_batch_tokens=1024 * 256, precision="auto", compile=False)
    report = find_batch_json(gpu_cli(launcher), run, "--gpu-memory", "3GiB", "--start", "512", "--max", "1024")
    assert report["isolation"] == "in-process" and report["device"] == "cuda" and not report["compiled"]
    by_size = {t["micro_batch_size"]: t for t in report["trials"]}
    assert by_size[512]["reason"] == "OOM"
    # Had the OOM's memory stayed behind, every later size would fail too: sizes after it fit, in the same process.
    assert 0 < report["micro_batch"] < 512 and report["search_complete"]
    assert report["search_order"][0] == 512 and by_size[report["micro_batch"]]["tokens_per_s"] > 0


def gpu_cli(launcher: Launcher):
    """The launcher's commands with the GPU visible (they see none by default: tests/trainhelp.device_env)."""
    return lambda *argv: launcher.run(*argv, gpu=True)


# ----------------------------------------------------------------------- from the memory model's prediction


def test_search_from_a_prediction_steps_by_a_small_factor_either_way():
    # The prediction is a little low: up by 25% until a size fails, then bisect.
    found, tried = search(lambda size: size <= 45, 40, 1024, growth=1.25)
    assert found == 45 and tried[:2] == [40, 50]
    # A little high: down by 25% until a size fits, then bisect.
    found, tried = search(lambda size: size <= 37, 40, 1024, growth=1.25)
    assert found == 37 and tried[:2] == [40, 32]
    # Either way fewer trials than doubling from 1 (12, see test_search_doubles_then_bisects).
    assert len(tried) <= 6


def test_search_stops_after_max_trials_with_the_largest_size_that_fit():
    found, tried = search(lambda size: size <= 37, 1, 1024, max_trials=5)
    assert (found, tried) == (16, [1, 2, 4, 8, 16])
    found, tried = search(lambda size: False, 8, 1024, max_trials=2)
    assert (found, tried) == (0, [8, 4])


@pytest.mark.parametrize(("isolation", "cuda", "compiled", "in_process"), [
    ("auto", True, False, True),  # an OOM is caught and the memory freed: no fresh CUDA context per trial
    ("auto", True, True, False),  # compile: a fresh process per trial, as before
    ("auto", False, False, False),  # the CPU: the parent watches and kills a trial past --max-memory
    ("process", True, False, False),
    ("in-process", False, True, True),
])
def test_trials_run_in_process_only_where_that_is_safe(isolation: str, cuda: bool, compiled: bool,
                                                       in_process: bool):
    from nanopt.plan.find_batch.search import trials_in_process

    assert trials_in_process(isolation, cuda=cuda, compiled=compiled) is in_process


def test_the_search_starts_at_the_memory_models_prediction(tmp_path: Path, tiny_dataset: Path, cli_on_cpu):
    run = tiny_run(tmp_path, tiny_dataset, "run", global_batch_tokens=6 * 16)  # 1, 2, 3 and 6 sequences divide it
    report = find_batch_json(cli_on_cpu, run, "--max-memory", "4GiB", "--max", "3")
    # 4 GiB holds thousands of sequences of this model: the search starts at --max, one trial instead of 1, 2, 3.
    assert report["predicted_micro_batch"] >= 3
    assert report["search_order"] == [3] and report["micro_batch"] == report["max_micro_batch"] == 3
    assert report["search_complete"] and report["seconds"] > 0
    assert report["isolation"] == "process"


def test_the_memory_models_largest_is_one_statement(tmp_path: Path, tiny_dataset: Path, cli_on_cpu,
                                                    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """Before any trial (the search's start) this process's memory stands in for a trial's baseline on the CPU;
    after them the model has the measured one. One row gives the model's largest, the start only as what it is."""
    report = find_batch_json(cli_on_cpu, tiny_run(tmp_path, tiny_dataset, "run", global_batch_tokens=6 * 16),
                             "--max-memory", "4GiB", "--max", "3")
    first, largest = report["predicted_micro_batch"], report["calibration"]["predicted_max_micro_batch"]
    from nanopt.cli.commands.find_batch import render

    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    capsys.readouterr()
    render(report)
    rows = {line.split("\u2502")[1].strip(): line.split("\u2502")[2].strip()
            for line in capsys.readouterr().out.splitlines() if line.count("\u2502") == 3}
    assert rows["search"].startswith("started at 3 (from the memory model's estimate)"), rows["search"]
    assert first != largest  # this process holds more than a fresh trial process does
    assert rows["memory model: largest"] == (f"{largest}, of the usable sizes 6 (error -); {first} before the first "
                                             "trial measured a process's own memory (the search's start)")


def test_in_process_trials_are_judged_by_their_own_peak_and_bounded_in_number(tmp_path: Path, tiny_dataset: Path,
                                                                             cli_on_cpu):
    run = tiny_run(tmp_path, tiny_dataset, "run", global_batch_tokens=8 * 16)
    roomy = find_batch_json(cli_on_cpu, run, "--isolation", "in-process", "--max-memory", "64GiB", "--start", "1",
                            "--max", "8", "--max-trials", "2")
    assert roomy["isolation"] == "in-process" and roomy["search_order"] == [1, 2]
    assert roomy["micro_batch"] == 2 and not roomy["search_complete"]  # stopped by --max-trials, not by a failure
    assert all(t["fits"] and t["peak_memory_bytes"] > 0 and t["tokens_per_s"] > 0 for t in roomy["trials"])
    # This process alone holds more than 64 MiB: every size is over the bound, measured in this process.
    tight = find_batch_json(cli_on_cpu, run, "--isolation", "in-process", "--max-memory", "64MiB", "--start", "2",
                            "--max", "2")
    assert tight["micro_batch"] == 0 and tight["search_order"] == [2, 1]
    assert [t["reason"] for t in tight["trials"]] == ["over limit", "over limit"]
    assert all(t["peak_memory_bytes"] > 64 * 2**20 for t in tight["trials"])


def test_search_from_a_prediction_far_off_speeds_up_to_doubling():
    # The memory model 100x too optimistic: steps of 1.25x, 1.56x, 1.95x, then 2x, not 20 steps of 1.25x.
    found, tried = search(lambda size: size <= 10, 1000, 1024, growth=1.25)
    assert found == 10 and len(tried) <= 12, tried


# ------------------------------------------------------------------------------ only sizes the run can use


def test_only_sizes_that_divide_the_global_batch_are_searched():
    """A global batch of 96 sequences per rank: 100 fits but no run could use it; the answer is 96."""
    from nanopt.config import TrainConfig
    from nanopt.plan.find_batch.search import search_among, usable_micro_batches

    train = TrainConfig(data="d", micro_batch_size=4, global_batch_tokens=96 * 256 * 2)
    sizes = usable_micro_batches(train, seq_len=256, world_size=2, maximum=1024)
    assert sizes == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    found, tried = search_among(lambda size: size <= 100, sizes, start=1)
    assert found == 96 and set(tried) <= set(sizes)
    found, tried = search_among(lambda size: size <= 40, sizes, start=30, growth=1.25)
    assert found == 32 and tried[0] == 24 and set(tried) <= set(sizes)
    assert usable_micro_batches(train, seq_len=256, world_size=2, maximum=10) == [1, 2, 3, 4, 6, 8]


def test_from_a_prediction_the_search_steps_to_the_next_usable_size_not_past_it():
    """The third H100 window: the memory model predicted 188 sequences of GPT-2 small, the usable sizes were the
    powers of two, 128 fit and 256 did not. Steps of 25% from 128 reach 256; the search stepped in positions
    instead (8 x 1.25 = 10) and tried 512 before 256, one trial more, each a compilation on a GPU."""
    from nanopt.plan.find_batch.search import PREDICTED_GROWTH, search_among

    sizes = [2**i for i in range(11)]
    assert search_among(lambda size: size <= 150, sizes, start=188, growth=PREDICTED_GROWTH) == (128, [128, 256])
    # A step lands on the usable size nearest 25% more, not the first one past it: 24 -> 32 -> 48 (not 96).
    divisors = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    assert search_among(lambda size: size <= 40, divisors, start=30, growth=PREDICTED_GROWTH) == (32, [24, 32, 48])
    # Without a prediction, doubling: one power of two at a time up to the first failure.
    assert search_among(lambda size: size <= 150, sizes, start=1)[1] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_a_global_batch_no_micro_batch_divides_is_refused_before_any_trial(tmp_path: Path, tiny_dataset: Path,
                                                                          cli_on_cpu):
    run = tiny_run(tmp_path, tiny_dataset, "run", global_batch_tokens=100)  # seq_len 16: 6.25 sequences
    result = cli_on_cpu("find-batch", run, "--max-memory", "4GiB")
    assert_user_error(result, "global_batch_tokens 100 is not a multiple of seq_len x world size = 16 x 1",
                      "multiple of 16")
    assert not (run / "find_batch.json").exists()


def test_a_cpu_search_tries_only_usable_sizes(tmp_path: Path, tiny_dataset: Path, cli_on_cpu):
    run = tiny_run(tmp_path, tiny_dataset, "run", global_batch_tokens=6 * 16)
    report = find_batch_json(cli_on_cpu, run, "--max-memory", "4GiB", "--start", "1", "--max", "5")
    assert report["usable_micro_batches"] == [1, 2, 3]
    assert set(report["search_order"]) <= {1, 2, 3} and report["max_micro_batch"] == 3
    assert all(t["grad_accum"] is not None for t in report["trials"])
    assert report["max_micro_batch_capped"] and report["search_complete"]


def test_a_trial_steps_as_the_run_will_so_accumulation_counts_the_gradients(tmp_path: Path, tiny_dataset: Path):
    """A run that accumulates holds its gradients while the later micro-batches run forward (4 bytes a parameter:
    4.6 GiB on a 1B model, more than find-batch's margin). A trial at a size where the run accumulates steps two
    micro-batches, one where it does not steps one; the memory model the search starts from and calibrates
    against counts the gradients at the same sizes."""
    from nanopt.config import load_run
    from nanopt.plan.find_batch.calibration import predict_micro_batch
    from nanopt.plan.find_batch.search import trial_run

    seq = 32  # make_run's model: max_position_embeddings 32
    run = load_run(make_run(tmp_path, tiny_dataset, "eight", micro_batch_size=2, global_batch_tokens=8 * seq))
    assert [trial_run(run, size, 1).train.global_batch_tokens // seq for size in (1, 2, 4, 8)] == [2, 4, 8, 8]
    assert trial_run(run, 2, 2).train.global_batch_tokens == 2 * 2 * 2 * seq  # two micro-batches on each rank

    # A run that accumulates at every size tried: a limit that holds 8 sequences of one-micro-batch steps holds
    # fewer once the gradients stay allocated.
    from nanopt.model.memory import estimate_memory

    accumulating = load_run(make_run(tmp_path, tiny_dataset, "huge", micro_batch_size=2,
                                     global_batch_tokens=4096 * seq))
    one_a_step = estimate_memory(run.model, seq, precision="bf16", compiled=False, activation_checkpointing=False,
                                 parallelism="ddp", world_size=1, step_sequences=0)
    limit = one_a_step.total(8)
    assert one_a_step.max_micro_batch(limit) == 8
    assert predict_micro_batch(accumulating, 1, "bf16", False, limit) < 8


# Wide and shallow, one short sequence a micro-batch: 50.9M parameters (203 MB of fp32 weights) against a few MB of
# activations, so a log step's update, where run health copies the weights, is the trial's peak.
WIDE_MODEL = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 3, "num_attention_heads": 8,
              "num_key_value_heads": 8, "max_position_embeddings": 32}


def test_a_trial_measures_the_log_steps_copy_of_the_weights_that_run_health_takes(tmp_path: Path,
                                                                                  tiny_dataset: Path, cli_on_cpu):
    from nanopt.config import load_run
    from nanopt.model.flops import count_params

    run = make_run(tmp_path, tiny_dataset, model=WIDE_MODEL, micro_batch_size=1, global_batch_tokens=32)
    params = count_params(load_run(run).model).total
    peaks = {health: find_batch_json(cli_on_cpu, run, "--max-memory", "8GiB", "--start", "1", "--max", "1",
                                     "--set", f"health={health}")["trials"][0]["peak_memory_bytes"]
             for health in ("true", "false")}
    assert peaks["true"] - peaks["false"] == pytest.approx(4 * params, rel=0.15), (peaks, 4 * params)
