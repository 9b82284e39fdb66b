"""A data phase switch is seen where it happens: one console line at the first step that reads the phase, one
`data_phase` event in metrics.jsonl at that step, every phase's steps and weights in the end-of-run table, and a
line on loss.png where the phase begins. A resume on either side of the switch, or from a checkpoint before an
event already written, leaves exactly one event per phase, at its step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from mixturehelp import mixture
from trainhelp import make_run

from nanopt.train.observe.events import Silent

# 8 samples a step (make_run: 256 tokens of 32); phase 2 (web and math alike) from 0-based step 6, phase 3 (code 1,
# math 3) from step 12: blocks of 2 and 4 samples, so every step reads each phase's weights exactly.
PHASES = [{"from": 6, "mixture": {"web": 1, "math": 1}}, {"from": 12, "mixture": {"code": 1, "math": 3}}]
TRAIN = {"data_phases": PHASES, "max_steps": 18, "eval_interval": 0, "checkpoint_interval": 5, "warmup_steps": 2}
LINES = ["step 7: data phase 2 of 3 from here on (data_phases[0]): web 0.50, math 0.50",
         "step 13: data phase 3 of 3 from here on (data_phases[1]): code 0.25, math 0.75"]


def _run(tmp_path: Path, sources: dict[str, Path], name: str = "run") -> Path:
    return make_run(tmp_path, sources["web"], name, data=mixture(sources), **TRAIN)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _phase_events(run: Path) -> list[tuple[int, int]]:
    return [(r["step"], r["phase"]) for r in _records(run) if r.get("event") == "data_phase"]


class Stop(Silent):
    """Hears the notes; after the train record of step `after`, a SIGTERM (the run saves the next step and stops)
    or a KeyboardInterrupt (the run stops without saving: as a kill, it resumes from its last checkpoint)."""

    def __init__(self, after: int | None = None, how: str = "sigterm") -> None:
        self.after, self.how, self.notes = after, how, []

    def note(self, text: str) -> None:
        self.notes.append(text)

    def log(self, record: dict, total_steps: int) -> None:
        if record["step"] == self.after and self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif record["step"] == self.after:
            raise KeyboardInterrupt


def _train(run: Path, observer: Stop) -> list[str]:
    from nanopt.config import load_run
    from nanopt.train.loop import train
    from nanopt.train.session import TrainOptions

    try:
        train(load_run(run), TrainOptions(), observer)
    except KeyboardInterrupt:
        pass
    return [note for note in observer.notes if "data phase" in note]


def test_a_phase_switch_is_said_recorded_tabled_and_charted(tmp_path: Path, mixture_sources: dict[str, Path],
                                                            cli_in_process):
    from nanopt.train.observe.metrics import event_marks, loss_chart, read_metrics

    run = _run(tmp_path, mixture_sources)
    result = cli_in_process("train", run, "--no-live")
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "data phase" in line]
    assert said == LINES
    events = [r for r in _records(run) if r.get("event") == "data_phase"]
    assert [(e["step"], e["phase"], e["phases"], e["label"], e["data_step"]) for e in events] == [
        (7, 2, 3, "data_phases[0]", 6), (13, 3, 3, "data_phases[1]", 12)]
    assert events[1]["weights"] == {"web": 0.0, "code": 0.25, "math": 0.75}
    # The switch is where the data changed: code is read up to step 6, not in steps 7-12, and again from step 13.
    code = {r["step"]: r["sources"]["code"]["tokens"] for r in _records(run) if r["kind"] == "train"}
    assert code[5] < code[6] == code[7] == code[12] < code[13]

    table = result.stdout
    assert "weight, steps 1-6" in table and "weight, steps 7-12" in table and "weight, steps 13-18" in table
    math_row = next(line for line in table.splitlines() if line.strip("│ ").startswith("math"))
    assert [cell.strip() for cell in math_row.split("│")[2:5]] == ["0.100", "0.500", "0.750"]

    tokens_per_step = 256
    assert event_marks(read_metrics(run))["data_phase"] == [6 * tokens_per_step, 12 * tokens_per_step]
    figure = loss_chart(run)
    drawn = [line for line in figure.axes[0].get_lines() if line.get_color() == "tab:green"]
    assert [line.get_xdata()[0] for line in drawn] == [6 * tokens_per_step, 12 * tokens_per_step]
    assert any("data phase begins: 2 times" in text.get_text() for text in figure.axes[0].get_legend().get_texts())


def test_a_resume_across_a_switch_neither_repeats_nor_loses_its_event(tmp_path: Path,
                                                                       mixture_sources: dict[str, Path]):
    # Saved at step 6, the last of phase 1: the resumed session says phase 2 at step 7.
    before = _run(tmp_path, mixture_sources, "before")
    assert _train(before, Stop(after=5)) == []
    assert _train(before, Stop()) == LINES
    # Saved at step 7, phase 2's first: its event was written before that checkpoint and is not said again.
    at = _run(tmp_path, mixture_sources, "at")
    assert _train(at, Stop(after=6)) == LINES[:1]
    assert _train(at, Stop()) == LINES[1:]
    # Stopped at step 8 without saving (a kill): resumed from step 5, which drops the event of step 7 with the
    # records after the checkpoint, and says it again at step 7.
    killed = _run(tmp_path, mixture_sources, "killed")
    assert _train(killed, Stop(after=8, how="interrupt")) == LINES[:1]
    assert _train(killed, Stop()) == LINES
    for run in (before, at, killed):
        assert _phase_events(run) == [(7, 2), (13, 3)], run.name


def test_a_rollback_that_drops_the_event_says_the_phase_again_where_the_weights_first_read_it(
        tmp_path: Path, mixture_sources: dict[str, Path], cli_in_process):
    # 30 healthy steps (the spike watch's history), saved at step 30; phase 2 from the next step on. Resumed with a
    # learning rate of 10, the run reads phase 2 from step 31, spikes or diverges, and rolls back to step 30,
    # which drops the event of step 31 with the steps after the checkpoint, and skips data: the retrained step 31
    # reads phase 2 again, further on in it.
    run = make_run(tmp_path, mixture_sources["web"], data=mixture(mixture_sources), max_steps=60, eval_interval=0,
                   checkpoint_interval=5, data_phases=[{"from": 30, "mixture": {"web": 1, "math": 1}}])
    assert _train(run, Stop(after=29)) == []
    result = cli_in_process("train", run, "--no-live", "--set", "learning_rate=10", "--set",
                            "recovery_lr_factor=0.0003", "--set", "recovery_lr_steps=1000000", "--allow-changed")
    assert result.returncode == 0, result.stderr
    [recovery] = [r for r in _records(run) if r.get("event") == "recovery"]
    assert recovery["to_step"] == 30
    [event] = [r for r in _records(run) if r.get("event") == "data_phase"]
    assert (event["step"], event["phase"]) == (31, 2)
    assert event["data_step"] == 30 + recovery["skipped_samples"] // 8  # 8 samples a step
    assert result.stderr.count("data phase 2 of 2 from here on") == 2  # said before the rollback, and after it
