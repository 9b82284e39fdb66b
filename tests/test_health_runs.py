"""Run health for real: tiny CPU runs that provoke each verdict (a learning rate far too small, far too large, a
mis-scaled initialisation), a healthy one that gives none, --on-event, `nanopt eval --health`, and the signals'
numbers under Muon and on two ranks."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from clihelp import assert_user_error, run_cli
from trainhelp import make_run

SHORT = {"max_steps": 30, "eval_interval": 0, "checkpoint_interval": 0}


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def said(run: Path) -> list[tuple[str, int, str, dict]]:
    return [(r["verdict"], r["step"], r["message"], r["evidence"]) for r in records(run, "event")
            if r["event"] == "health"]


def verdicts(run: Path) -> list[tuple[str, int]]:
    return [(r["verdict"], r["step"]) for r in records(run, "event") if r["event"] == "health"]


def train(cli_in_process, run: Path, *extra: str):
    result = cli_in_process("train", run, "--no-live", *extra)
    assert result.returncode == 0, result.stderr
    return result


def test_a_healthy_run_records_the_signals_and_reaches_no_verdict(tmp_path: Path, tiny_dataset: Path,
                                                                  cli_in_process):
    run = make_run(tmp_path, tiny_dataset, **{**SHORT, "max_steps": 60})
    result = train(cli_in_process, run)
    assert verdicts(run) == []
    assert "health:" not in result.stderr
    logged = records(run, "train")
    assert len(logged) == 60
    for r in logged:
        assert set(r["grad_norm_blocks"]) == {"embed_tokens", "layers.0", "layers.1", "norm"}  # the head is tied
        blocks = math.sqrt(sum(v * v for v in r["grad_norm_blocks"].values()))
        assert blocks == pytest.approx(r["grad_norm"], rel=1e-4)  # the blocks make up the norm clipping uses
        assert 1e-4 < r["update_ratio"]["decay"] < 1.0
    blocks = [block for r in logged for block in r["health_blocks"]]
    assert [(b["first"], b["last"]) for b in blocks] == [(step - 1, step) for step in range(2, 61, 2)]
    for b in blocks:  # every step's loss and norm, each in one block
        steps = [r for r in logged if b["first"] <= r["step"] <= b["last"]]
        assert b["loss_sum"] == pytest.approx(sum(r["loss"] for r in steps))
        assert b["norm_max"] == pytest.approx(max(r["grad_norm"] for r in steps))
        assert b["clipped"] == sum(r["grad_norm"] > 1.0 for r in steps)
    assert logged[-1]["loss_trend"] < 0
    assert "health of this run" in result.stdout and "none" in result.stdout


def test_a_learning_rate_far_too_small_is_a_plateau_and_stagnating_updates_each_said_once(
        tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, learning_rate=1e-7, **SHORT)
    out = tmp_path / "events.txt"
    result = train(cli_in_process, run, "--on-event", f'echo "$NANOPT_EVENT $NANOPT_EVENT_STEP" >> {out}')
    reached = verdicts(run)
    assert sorted(name for name, _ in reached) == ["plateau", "stagnating_updates"]
    assert all(13 <= step <= 30 for _, step in reached)  # after the warmup (3) and one window (10 steps)
    for name, _ in reached:
        assert result.stderr.count(f"health: {name}") == 1
    assert "raise learning_rate" in result.stderr
    lines = _wait_for_lines(out, 2)  # the command runs in the background, once per verdict
    assert sorted(lines) == sorted(f"{name} {step}" for name, step in reached)
    assert "on_event" in (run / "on_event.log").read_text()


def test_a_learning_rate_far_too_large_is_exploding_gradients_with_what_it_saw(tmp_path: Path, tiny_dataset: Path,
                                                                               cli_in_process):
    run = make_run(tmp_path, tiny_dataset, learning_rate=5.0, recovery=False, **SHORT)
    out = tmp_path / "payload.txt"
    result = train(cli_in_process, run, "--on-event", f'echo "$NANOPT_EVENT_MESSAGE" >> {out}')
    assert [name for name, _ in verdicts(run)] == ["exploding_gradients"]
    assert result.stderr.count("health: exploding_gradients") == 1
    assert "lower learning_rate" in result.stderr
    assert "exploding_gradients" in result.stdout  # the end-of-run table
    event = next(r for r in records(run, "event") if r["event"] == "health")
    seen = event["evidence"]
    assert seen["norm_median"] > 10 * seen["grad_clip"]  # far above the clip, not near it
    first, last = seen["steps"]
    norms = sorted(r["grad_norm"] for r in records(run, "train") if first <= r["step"] <= last)
    assert norms[0] <= seen["norm_median"] <= norms[-1]
    said = f"median is {seen['norm_median']:.3g} over steps {first}-{last} (grad_clip 1"
    assert said in event["message"] and said in " ".join(result.stderr.split())  # as the console wraps it
    assert said in " ".join(_wait_for_lines(out, 1))  # the --on-event command hears the same numbers


def test_clipping_near_the_threshold_is_no_verdict(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    """The tiny model's gradient norm sits at 0.6-0.9: with grad_clip 0.5 every step is clipped, which is clipping
    at work, not an explosion (the demo's norm hovers around its grad_clip of 1.0 early on, just so)."""
    run = make_run(tmp_path, tiny_dataset, grad_clip=0.5, **{**SHORT, "max_steps": 60})
    result = train(cli_in_process, run)
    logged = records(run, "train")
    assert sum(r["grad_norm"] > 0.5 for r in logged) > 0.8 * len(logged)
    assert verdicts(run) == [] and "health:" not in result.stderr


@pytest.mark.parametrize("learning_rate", [5.0, 1e-7])
def test_the_verdicts_do_not_depend_on_the_log_interval_and_eval_health_replays_them(
        tmp_path: Path, tiny_dataset: Path, cli_in_process, learning_rate: float):
    """The same run logged every 1, 10 and 50 steps: the same blocks of every step's numbers, so the same
    verdicts from them, said at the same steps with the same numbers; and `eval --health` on a copy of the file
    without the verdicts' events reaches them again from the blocks. (The update ratio is measured at log steps
    only: logging every 10 steps of a 30-step run, with 10-step windows, measures too seldom to judge it.)"""
    seen = {}
    for interval in (1, 10, 50):
        run = make_run(tmp_path, tiny_dataset, name=f"every-{interval}", learning_rate=learning_rate,
                       recovery=False, log_interval=interval, **SHORT)
        train(cli_in_process, run)
        logged = records(run, "train")
        said = [(r["verdict"], r["step"], r["message"]) for r in records(run, "event") if r["event"] == "health"]
        seen[interval] = ([b for r in logged for b in r["health_blocks"]],
                          [v for v in said if v[0] != "stagnating_updates"])
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if '"event": "health"' not in line))
        replayed = cli_in_process("eval", run, "--health", "--json")
        assert replayed.returncode == 0, replayed.stderr
        assert [(v["name"], v["step"], v["message"]) for v in json.loads(replayed.stdout)["verdicts"]] == said
    assert seen[1] == seen[10] == seen[50]
    assert len(seen[1][0]) == 30 and seen[1][1]  # every step in a block; a verdict from them


def test_a_mis_scaled_initialisation_is_said_at_step_1(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    # Step 1 is not a log step (log_interval 10): the check sees every step's loss, not only the logged ones.
    run = make_run(tmp_path, tiny_dataset, model={"initializer_range": 2.0}, log_interval=10,
                   **{**SHORT, "max_steps": 3})
    result = train(cli_in_process, run)
    assert [r["step"] for r in records(run, "train")] == [3]
    assert verdicts(run) == [("initial_loss", 1)]
    assert "far above ln(512 token ids) = 6.238" in result.stderr
    assert "initializer_range" in result.stderr


def test_a_vocabulary_padded_past_the_data_is_judged_on_the_rows_the_softmax_covers(tmp_path: Path,
                                                                                      tiny_dataset: Path,
                                                                                      cli_in_process):
    # The second GPU window: GPT-2 small (vocab 50,304) on the built-in 1,024-token data started at 7.08 = ln(1,024)
    # as it should, and was told it was far below ln(50,304) = 10.83. The padded rows are out of the softmax.
    run = make_run(tmp_path, tiny_dataset, model={"vocab_size": 8192}, **{**SHORT, "max_steps": 3})
    result = train(cli_in_process, run)
    assert records(run, "train")[0]["loss"] == pytest.approx(math.log(512), abs=0.5)
    assert verdicts(run) == [] and "health:" not in result.stderr
    replayed = cli_in_process("eval", run, "--health", "--json")
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["verdicts"] == []


def test_health_off_records_no_signal(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, model={"initializer_range": 2.0}, health=False,
                   **{**SHORT, "max_steps": 3})
    train(cli_in_process, run)
    assert verdicts(run) == []
    assert all("update_ratio" not in r for r in records(run, "train"))


def test_a_resumed_run_does_not_say_its_verdict_again(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, learning_rate=1e-7, **{**SHORT, "checkpoint_interval": 20})
    train(cli_in_process, run, "--set", "max_steps=20")
    first = verdicts(run)
    assert "stagnating_updates" in [name for name, _ in first]
    result = train(cli_in_process, run, "--allow-changed")
    assert verdicts(run)[:len(first)] == first
    assert "health: stagnating_updates" not in result.stderr
    assert [name for name, _ in verdicts(run)].count("stagnating_updates") == 1


def test_a_resumed_run_judges_as_if_never_interrupted(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    """Trained again from its step-15 checkpoint, the run reaches its verdicts at the same steps with the same
    numbers: the resume restores the windows of blocks from metrics.jsonl, so a plateau that began before it is
    still seen."""
    run = make_run(tmp_path, tiny_dataset, learning_rate=1e-7, **{**SHORT, "checkpoint_interval": 15})
    train(cli_in_process, run)
    whole = said(run)
    assert any(step > 15 for _, step, _, _ in whole)
    train(cli_in_process, run, "--resume", run / "checkpoints" / "step-000015")
    assert said(run) == whole


def test_eval_health_replays_the_metrics_and_draws_the_chart(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, learning_rate=1e-7, **SHORT)
    train(cli_in_process, run)
    result = cli_in_process("eval", run, "--health", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(v["name"] for v in report["verdicts"]) == ["plateau", "stagnating_updates"]
    assert report["signals"]["step"] == 30 and report["signals"]["update_ratio"]["decay"] < 1e-5
    assert Path(report["chart"]) == run / "health.png" and (run / "health.png").read_bytes()[:4] == b"\x89PNG"
    table = cli_in_process("eval", run, "--health")
    assert "stagnating_updates" in table.stdout and "update / parameter" in table.stdout
    own = cli_in_process("health", run, "--json")  # the command of its own gives the same report
    assert own.returncode == 0 and json.loads(own.stdout) == report, own.stderr
    assert "stagnating_updates" in cli_in_process("health", run).stdout
    evaluated = cli_in_process("eval", run, "--no-samples", "--json")  # eval.json carries the same section
    assert evaluated.returncode == 0, evaluated.stderr
    saved = json.loads((run / "eval.json").read_text())["health"]
    assert sorted(v["name"] for v in saved["verdicts"]) == ["plateau", "stagnating_updates"]


def test_eval_health_judges_over_the_window_the_run_was_trained_with(tmp_path: Path, tiny_dataset: Path,
                                                                      cli_in_process):
    # train.json says 30 steps (a 10-step window); the run was trained for 80 with --set (a 20-step window). The
    # replay must judge as training did: from the checkpoint's snapshot, not from the file.
    run = make_run(tmp_path, tiny_dataset, **SHORT)
    result = cli_in_process("train", run, "--no-live", "--json", "--set", "max_steps=80")
    assert result.returncode == 0, result.stderr
    trained = json.loads(result.stdout)["health"]["signals"]["window_steps"]
    replayed = cli_in_process("eval", run, "--health", "--json")
    assert replayed.returncode == 0, replayed.stderr
    assert json.loads(replayed.stdout)["signals"]["window_steps"] == trained == 20


def test_eval_health_of_a_strangers_odd_values_is_no_traceback(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    """A metrics.jsonl from elsewhere: values no float holds, fields of the wrong shape, blocks that are not
    blocks. The replay passes over what it cannot use, and judges the rest."""
    run = make_run(tmp_path, tiny_dataset, **SHORT)
    huge = "1" + "0" * 400
    odd = [f'"grad_norm": {huge}', '"update_ratio": [1, 2]', '"update_ratio": {"decay": ' + huge + '}',
           '"grad_norm_blocks": {"layers.0": ' + huge + '}', '"health_blocks": {"first": 1}',
           '"health_blocks": [{"first": 5, "last": 1}, 7, {"first": 1, "last": 2, "steps": ' + huge + '}]',
           '"health_blocks": [{"first": 1, "last": ' + huge + ', "steps": 1, "losses": 1, "loss_sum": 5.0, '
           '"loss_squares": 25.0, "norm_median": 0.5, "norm_max": 0.5, "clipped": 0}]',
           '"lr": "fast"', '"loss_trend": []']
    lines = [f'{{"kind": "train", "step": {step}, "loss": 5.0, "grad_norm": 0.5, "lr": 0.001, '
             f'{odd[step % len(odd)]}}}' for step in range(1, 31)]
    lines.append('{"kind": "event", "event": "health", "verdict": ["plateau"], "step": 3}')
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = cli_in_process("eval", run, "--health", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["signals"]["step"] == 30 and Path(report["chart"]).is_file()


def test_eval_health_of_a_run_that_has_not_logged_is_one_line(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset)
    assert_user_error(cli_in_process("eval", run, "--health"), "no metrics.jsonl")
    assert_user_error(cli_in_process("eval", tmp_path / "missing", "--health"), "run directory not found")
    assert_user_error(cli_in_process("health", run), "no metrics.jsonl")


def test_muon_reports_its_matrices_ratio(tmp_path: Path, tiny_dataset: Path, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, optimizer="muon", **{**SHORT, "max_steps": 5})
    train(cli_in_process, run)
    ratios = records(run, "train")[-1]["update_ratio"]
    assert set(ratios) == {"decay", "no_decay", "muon"}
    assert 1e-4 < ratios["muon"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_measure_the_one_process_norms(tmp_path: Path, tiny_dataset: Path, parallelism: str):
    """The same global batch on one process and on two gloo ranks (FSDP2: each holds a shard, reduced): the same
    per-block gradient norms and update ratios."""
    settings = {**SHORT, "max_steps": 2, "parallelism": parallelism}
    one = make_run(tmp_path, tiny_dataset, name="one", **settings)
    two = make_run(tmp_path, tiny_dataset, name="two", **settings)
    for run, ranks in ((one, "1"), (two, "2")):
        result = run_cli("train", run, "--no-live", "--nproc-per-node", ranks, timeout=300,
                         env={"CUDA_VISIBLE_DEVICES": ""})
        assert result.returncode == 0, result.stderr
    for a, b in zip(records(one, "train"), records(two, "train"), strict=True):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        for block, norm in a["grad_norm_blocks"].items():
            assert b["grad_norm_blocks"][block] == pytest.approx(norm, rel=1e-4)
        for group, ratio in a["update_ratio"].items():
            assert b["update_ratio"][group] == pytest.approx(ratio, rel=1e-3)


def _wait_for_lines(path: Path, count: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.2)
    return path.read_text().splitlines() if path.exists() else []
