"""What nanopt shows of files that may come from someone else (docs/design.md, "The trust boundary"):
a path inside a suggested command pastes back as that path, control characters and rich markup from files are
shown and never obeyed, and train.json's on_exit is announced before the first step. Also two outcomes that were
once a traceback: a NaN from step 1 says there is nothing to roll back to and why, and estimate's rates are bounded.

Each case runs the real CLI (a subprocess, or a process forked by the warm launcher) on crafted directories.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from clihelp import assert_user_error, run_cli
from faulthelp import Launcher, tiny_run
from rich.text import Text
from trainhelp import make_run

from nanopt.cli.display import format as fmt
from nanopt.cli.terminal import SafeConsole
from nanopt.untrusted_text import printable, shell_word

# What a crafted value tries: set the window title (OSC), erase the line (CSI), a one-byte CSI (C1), reverse the
# text that follows (a bidi override), and rich markup, one tag of which closes nothing.
EVIL = "\x1b]0;pwned\x07\x1b[2K\x9b1A\u202e[red]x[/red]"
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def command_in(line: str) -> str:
    """The `nanopt ...` command a hint suggests: to the line's last backtick, as a path may hold one too."""
    found = re.search(r"`(nanopt .*)`", line)
    assert found, line
    return found.group(1)


def paste(command: str, cwd: Path) -> list[str]:
    """The arguments `command` gives nanopt when pasted into bash (nanopt stood in for by a function that prints
    them), run in `cwd`."""
    script = 'nanopt() { printf "%s\\0" "$@"; }\n' + command
    out = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, timeout=30, check=True).stdout
    return out.decode("utf-8", "surrogateescape").split("\0")[:-1]


# ------------------------------------------------------------------------------------------- the two helpers


@pytest.mark.parametrize("word", ["runs/demo", "runs/$(touch PWNED) x", "it's", "a\nb", "`id`", "-x", "ü/中"])
def test_shell_word_round_trips_and_leaves_plain_paths_readable(word: str):
    assert shlex.split(shell_word(word)) == [word]
    assert shell_word("runs/demo") == "runs/demo"


def test_printable_escapes_controls_and_keeps_ordinary_text():
    shown = printable(EVIL + "\r\udcff\x7f")
    assert not any(char in shown for char in (*RAW, "\r", "\udcff", "\x7f"))
    assert shown.startswith("\\x1b]0;pwned\\x07\\x1b[2K\\x9b1A\\u202e[red]x[/red]")
    assert printable("é 中文 🙂 tab\there") == "é 中文 🙂 tab\\there"
    assert printable("two\nlines\tand a tab", lines=True) == "two\nlines\tand a tab"


def test_the_console_escapes_text_that_rich_builds_itself():
    """A Text rendered without render_str (as a progress bar's columns are, on a terminal) is escaped on its way out."""
    out = io.StringIO()
    SafeConsole(file=out, force_terminal=True, color_system=None, width=200).print(Text(EVIL))
    assert not any(char in out.getvalue() for char in RAW)
    assert "\\x1b[2K" in out.getvalue()


# --------------------------------------------------------------------------- paths in suggested commands


@pytest.mark.parametrize("name", ["$(touch PWNED) x", "it's `touch PWNED`"])
def test_a_run_directory_in_a_hint_pastes_back_as_that_directory(tmp_path: Path, tiny_dataset: Path,
                                                                  launcher: Launcher, name: str):
    run = make_run(tmp_path / "runs", tiny_dataset, name)  # never trained: eval's hint says to train it
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = launcher.run("eval", run)
    assert_user_error(result, "no complete checkpoint", "train first")
    args = paste(command_in(result.stderr), scratch)
    assert args == ["train", str(run)]
    assert not list(scratch.iterdir()) and not (tmp_path / "PWNED").exists()


def test_train_jsons_data_in_a_hint_pastes_back_as_that_path(tmp_path: Path, tiny_dataset: Path,
                                                             launcher: Launcher):
    run = make_run(tmp_path / "runs", tiny_dataset, "run", data="../$(touch PWNED) data")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = launcher.run("train", run)
    assert_user_error(result, "dataset directory not found", "nanopt tokenize")
    args = paste(command_in(result.stderr), scratch)
    assert args[:3] == ["tokenize", "SOURCE", "--out"]
    assert Path(args[3]).resolve() == (run / "../$(touch PWNED) data").resolve()
    assert not list(scratch.iterdir())


# ------------------------------------------------------------------------------------ control characters


def test_a_crafted_run_name_is_shown_not_obeyed(tmp_path: Path, tiny_dataset: Path):
    """An ESC, a C1, a bidi override, a name that is not UTF-8, and markup that closes nothing (`[/x]`, across two
    directories) in a run's name: shown escaped and literal in estimate's table, not a traceback."""
    run = make_run(tmp_path / f"evil{EVIL}\udcff[bold]", tiny_dataset, "[/x]")
    result = run_cli("estimate", run, "--gpu", "cpu", "--peak-tflops", "0.1")
    assert result.returncode == 0, result.stderr
    assert not any(char in result.stdout + result.stderr for char in RAW)
    shown = "".join(result.stdout.split())  # the title, wrapped to the table's width
    assert "evil\\x1b]0;pwned\\x07\\x1b[2K\\x9b1A\\u202e[red]x[/red]\\udcff[bold]/[/x]" in shown


def test_a_crafted_train_json_value_in_an_error_stays_on_its_line(tmp_path: Path, tiny_dataset: Path,
                                                                  launcher: Launcher):
    run = make_run(tmp_path / "runs", tiny_dataset, "run", data=f"{EVIL}\nsecond line")
    result = launcher.run("train", run)
    assert_user_error(result, "dataset directory not found", "[red]x[/red]\\nsecond line")
    assert not any(char in result.stderr for char in RAW)
    assert "\\x1b]0;pwned\\x07\\x1b[2K" in result.stderr


# ------------------------------------------------------------------------------------------------- on_exit


def test_on_exit_from_train_json_is_announced_before_the_first_step(tmp_path: Path, tiny_dataset: Path,
                                                                    launcher: Launcher):
    marker = tmp_path / "ran"
    command = f"touch {shell_word(marker)} # {EVIL}"
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, log_interval=1, eval_interval=0, on_exit=command)
    child = launcher.train(run)
    lines = child.stderr.splitlines()
    [announced] = [i for i, line in enumerate(lines) if line.startswith("on_exit (from train.json)")]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/2"))
    assert announced < first_step
    assert printable(command) in lines[announced]
    assert not any(char in child.stderr for char in RAW)
    assert marker.exists()


def test_on_exit_from_the_command_line_is_not_announced(tmp_path: Path, tiny_dataset: Path, launcher: Launcher):
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=2, eval_interval=0, on_exit="true")
    for given in (["--on-exit", "exit 0"], ["--set", "on_exit=exit 0"]):
        child = launcher.train(run, "--set", "max_steps=1", "--allow-changed", *given)
        assert "on_exit (from train.json)" not in child.stderr
        assert 'on-exit: "exit 0" exited 0' in child.stderr


# ------------------------------------------------------------------------------------------- section 6


def test_a_nan_from_step_1_says_there_is_nothing_to_roll_back_to(tmp_path: Path, tiny_dataset: Path,
                                                                  launcher: Launcher):
    """Weights initialized at 1e20 overflow fp32 in the first forward: step 1's loss is NaN, recovery is on."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=20, eval_interval=0)
    model = json.loads((run / "model.json").read_text())
    (run / "model.json").write_text(json.dumps({**model, "initializer_range": 1e20}))
    child = launcher.run("train", run, "--no-live")
    error = [line for line in child.stderr.splitlines() if line.startswith("error:")]
    assert child.status == 2 and len(error) == 1, child.stderr[-3000:]
    assert "non-finite steps in a row at step 5, the first at step 1, before any checkpoint exists: nothing to " \
           "roll back to" in error[0]
    assert "no learning rate has acted yet" in error[0] and "precision" in error[0] and "step -1" not in error[0]


@pytest.mark.parametrize("option", ["--peak-tflops", "--mfu"])
def test_estimate_refuses_a_rate_that_would_make_every_time_absurd(option: str):
    assert_user_error(run_cli("estimate", "runs/demo", option, "1e-300"), option, "is outside")


def test_numbers_never_print_as_walls_of_digits():
    assert fmt.duration(1e30) == "> 1000 years" and fmt.duration(3 * fmt.YEAR_S) == "3.0 years"
    assert fmt.duration(90_061) == "1d 01h 01m"  # as before below a year
    for text in (fmt.money(1e40), fmt.count(1e40), fmt.exact(10**40), fmt.size(1e40), fmt.percent(1e40),
                 fmt.ratio(1e40), fmt.count(1e-300)):
        assert len(text) < 12, text
