"""Time and money per phase: what a run's wall-clock time went to, live ETA and cost, and the comparison of runs.

Real `nanopt train` runs (in this process, so the session is billed from the command's start) on a tiny model; the
wall time is measured around the command, from outside.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from trainhelp import make_run

PRICE = 3.6  # USD per GPU-hour: a dollar is 1000 device-seconds, easy to check by eye
PHASES = {"setup", "train", "eval", "checkpoint", "other"}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dataset):
    """A 40-step run (eval and checkpoint every 10) and its wall time seen from outside. 40 steps, not 20: the ETA
    after step 12 then foresees three evaluations, charts and checkpoints, not one, so a few milliseconds of
    scheduling noise on a shared machine no longer decide whether it is within its tolerance."""
    # The first loss chart's imports (~1 s) would dominate a 5 s run's "other".
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401

    from nanopt.cli import main

    run = make_run(tmp_path_factory.mktemp("phases"), tiny_dataset, "priced", log_interval=2, eval_interval=10,
                   eval_tokens=256, max_steps=40)
    started = time.time()
    try:
        main(["train", str(run), "--json", "--price-per-hour", str(PRICE)])
    except SystemExit as exc:
        assert not exc.code
    wall = time.time() - started
    return run, wall


def summary_of(run: Path) -> dict:
    """The run's time as `nanopt train` reported it, from its last phases record (the summary's source)."""
    last = [r for r in records(run) if r["kind"] == "phases"][-1]
    return last


def within_other_share(eta: float, foreseen: float, at: dict, phases_before: dict, steps: int) -> bool:
    """Whether `eta`, the ETA of log line `at`, is `foreseen` (the phases left at their latest durations) grown by
    the session's share of other time at that line. No record holds that share whole: the last phases record
    (`phases_before`, its seconds) came `steps` steps earlier, and those steps took no more than the line's log
    window, so the share lies between two bounds that the records do give (2% kept for the instants between them)."""
    worked = phases_before["train"] + phases_before["eval"] + phases_before["checkpoint"]
    least_worked, most_worked = worked, worked + steps * at["step_time_s"]
    since_setup = at["elapsed_s"] - phases_before["setup"]
    most = foreseen * (since_setup / least_worked)  # 1 + other / worked, other being since_setup - worked
    least = foreseen * (since_setup / most_worked)
    return 0.98 * least <= eta <= 1.02 * most


def test_phase_times_add_up_to_the_wall_time_seen_from_outside(trained):
    run, wall = trained
    last = summary_of(run)
    seconds = last["seconds"]
    assert set(seconds) == PHASES
    assert sum(seconds.values()) == pytest.approx(last["wall_s"], rel=1e-6)
    # The session's clock and a stopwatch around the command agree within a few percent (the rest is the summary
    # printed after the last record, and the run directory's lock released).
    assert last["wall_s"] == pytest.approx(wall, rel=0.05, abs=0.3)
    assert min(seconds["setup"], seconds["train"], seconds["eval"], seconds["checkpoint"]) > 0
    # "train" is the steps alone: no more than the log lines' windows of 2 steps, which also hold their logging.
    logged = sum(2 * r["step_time_s"] for r in records(run) if r["kind"] == "train")
    assert 0.2 * logged < seconds["train"] <= logged
    assert last["world_size"] == 1 and last["price_per_hour"] == PRICE


def test_every_metrics_record_carries_a_wall_clock_time(trained):
    run, _ = trained
    times = [r["time"] for r in records(run)]
    assert all(isinstance(t, float) for t in times)
    assert times == sorted(times)
    assert times[-1] - times[0] < 600  # seconds since the epoch, not a counter


def test_log_lines_carry_eta_and_money_that_add_up(trained):
    run, _ = trained
    train = [r for r in records(run) if r["kind"] == "train"]
    for r in train:
        assert r["spent_usd"] == pytest.approx(r["elapsed_s"] * PRICE / 3600, rel=1e-6)
        assert r["to_finish_usd"] == pytest.approx(r["eta_s"] * PRICE / 3600, rel=1e-6)
    assert train[-1]["eta_s"] == 0
    assert [r["spent_usd"] for r in train] == sorted(r["spent_usd"] for r in train)
    # The ETA at step 12 foresees the rest of the run at the durations measured last: the 28 steps left at that log
    # line's step time, the evaluations and checkpoints at 20, 30 and 40 at the durations of those at step 10, all
    # grown by the session's share of other time (log lines, charts). Checked against the durations the run
    # recorded, not a stopwatch: on a shared machine the future can be slower than the past, and that is not the
    # ETA's fault (the share of other time is bounded as within_other_share says).
    at = next(r for r in train if r["step"] == 12)
    at_10 = [r for r in records(run) if r["kind"] == "phases" and r["step"] == 10][-1]["seconds"]
    saved = next(r for r in records(run) if r.get("event") == "checkpoint" and r["step"] == 10)
    foreseen = 28 * at["step_time_s"] + 3 * at_10["eval"] + 3 * saved["blocked_s"]
    assert within_other_share(at["eta_s"], foreseen, at, at_10, steps=2)
    assert at["eta_s"] >= foreseen


def test_the_eta_foresees_the_evaluations_left(tmp_path, tiny_dataset, cli_in_process):
    # Evaluation is most of this run's time, so an ETA that left it out would be far off.
    run = make_run(tmp_path, tiny_dataset, "evalheavy", max_steps=6, eval_interval=2, eval_tokens=16384,
                   checkpoint_interval=0, log_interval=1)
    assert cli_in_process("train", run, "--json").returncode == 0
    at = next(r for r in records(run) if r["kind"] == "train" and r["step"] == 3)
    at_2 = [r for r in records(run) if r["kind"] == "phases" and r["step"] == 2][-1]["seconds"]
    foreseen = 3 * at["step_time_s"] + 2 * at_2["eval"]  # steps 4-6, evaluations at 4 and 6; no checkpoint timed yet
    assert 2 * at_2["eval"] > 3 * at["step_time_s"]
    assert within_other_share(at["eta_s"], foreseen, at, at_2, steps=1)


def test_phase_records_survive_a_resume_that_drops_later_steps(tmp_path):
    from nanopt.train.observe.metrics import MetricsLog

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"kind": "train", "step": 10}, {"kind": "phases", "step": 12, "session_start": 1.0, "wall_s": 5},
             {"kind": "train", "step": 12}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    MetricsLog(run, enabled=True).truncate_after(10)
    kept = records(run)
    assert [r["kind"] for r in kept] == ["train", "phases"]  # the time spent on steps 11-12 was still paid for


def test_a_resumed_run_adds_up_every_session(tmp_path, tiny_dataset, cli_in_process):
    run = make_run(tmp_path, tiny_dataset, "twice", max_steps=6, eval_interval=3, checkpoint_interval=3)
    first = cli_in_process("train", run, "--json", "--price-per-hour", PRICE)
    assert first.returncode == 0, first.stderr
    second = cli_in_process("train", run, "--json", "--set", "max_steps=9", "--allow-changed")
    assert second.returncode == 0, second.stderr
    one, two = json.loads(first.stdout)["time"], json.loads(second.stdout)["time"]
    assert (one["sessions"], two["sessions"]) == (1, 2)
    sessions = {r["session_start"]: r for r in records(run) if r["kind"] == "phases"}
    assert len(sessions) == 2
    assert two["wall_seconds"] == pytest.approx(sum(r["wall_s"] for r in sessions.values()), rel=0.02)
    # The second session had no price given: the whole run is unpriced on a CPU, not quietly half-priced.
    assert two["cost_usd"] is None and one["cost_usd"] == pytest.approx(one["device_hours"] * PRICE)


def test_costly_evaluation_is_named_with_the_settings_that_bring_it_under_10_percent(tmp_path, tiny_dataset,
                                                                                      cli_in_process):
    run = make_run(tmp_path, tiny_dataset, "evalheavy", max_steps=8, eval_interval=2, eval_tokens=8192,
                   checkpoint_interval=0)
    result = cli_in_process("train", run)
    assert result.returncode == 0, result.stderr
    event = next(r for r in records(run) if r.get("event") == "eval_share")
    assert event["share"] > 0.10
    assert f"eval_interval {event['eval_interval']}" in result.stderr
    assert f"eval_tokens {event['eval_tokens']:,}" in result.stderr
    # The advice is the arithmetic of the times measured in the interval before the warning: an interval that
    # long puts evaluation under 10%.
    phases_at = {r["step"]: r["seconds"] for r in records(run) if r["kind"] == "phases"}
    now, before = phases_at[event["step"]], phases_at[event["step"] - 2]
    step_s = (now["train"] - before["train"]) / 2
    assert event["step_s"] == pytest.approx(step_s)
    last_eval = [r for r in records(run) if r["kind"] == "eval" and r["step"] == event["step"]][-1]["eval_s"]
    assert last_eval / (last_eval + event["eval_interval"] * step_s) <= 0.11
    assert event["eval_interval"] > 2 and event["eval_tokens"] < 8192


def test_a_cheap_evaluation_is_not_flagged(trained):
    run, _ = trained  # 256 tokens every 10 steps: a few percent of the time
    evals = [r["eval_s"] for r in records(run) if r["kind"] == "eval"]
    assert not [r for r in records(run) if r.get("event") == "eval_share"], evals


def test_eval_compare_shows_time_and_money_per_phase(trained, tmp_path, cli_in_process):
    import shutil

    run, _ = trained
    other = tmp_path / "copy"
    shutil.copytree(run, other)
    recorded = cli_in_process("eval", run, other, "--no-samples", "--json")
    assert recorded.returncode == 0, recorded.stderr
    rows = json.loads(recorded.stdout)["runs"]
    for row in rows:  # priced at the price each session trained with
        assert set(row["time"]["phases"]) == PHASES
        assert row["cost_usd"] == pytest.approx(row["gpu_hours"] * PRICE)
        eval_cost = row["time"]["phases"]["eval"]["cost_usd"]
        assert row["cost_excluding_eval_usd"] == pytest.approx(row["cost_usd"] - eval_cost)
        assert row["wall_seconds"] == pytest.approx(summary_of(run)["wall_s"], rel=1e-6)
    repriced = cli_in_process("eval", run, other, "--no-samples", "--json", "--price-per-hour", "7.2")
    assert json.loads(repriced.stdout)["runs"][0]["cost_usd"] == pytest.approx(2 * rows[0]["cost_usd"])
    table = cli_in_process("eval", run, other, "--no-samples")
    assert "time per phase" in table.stdout and "w/o eval" in table.stdout


def test_one_slow_evaluation_is_noise_two_in_a_row_are_a_cost():
    from nanopt.train.observe.phases import EvalShareWatch

    watch = EvalShareWatch()
    # (step, the session's train seconds so far, the evaluation's seconds): 10 steps of 0.1 s between evaluations;
    # the first interval holds a 30 s compile, which must not hide anything later.
    assert watch.costly(10, 31.0, 0.05) is None  # the first evaluation only marks the start
    assert watch.costly(20, 32.0, 0.50) is None  # 33%, but once: a busy moment
    assert watch.costly(30, 33.0, 0.05) is None
    assert watch.costly(40, 34.0, 0.20) is None
    share, step_s = watch.costly(50, 35.0, 0.25)  # 17% and 20%: two intervals running
    assert share == pytest.approx(0.25 / 1.25) and step_s == pytest.approx(0.1)
    assert watch.costly(60, 36.0, 0.25) is None  # said once
