"""What a newcomer reads in `nanopt COMMAND --help`: each value is named in words (RUN, N, SIZE), never by its Python
type, and each example stands on its own line, whatever the terminal's width."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from nanopt.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)
WIDTHS = (100, 200)

# What Typer shows for a value nobody named: <int>, <path>, <list[str]>, <int range>, <bool> for a flag.
PYTHON_TYPE = re.compile(r"<[a-z][a-z_ ,|\[\]]*>|\b(?:list|tuple|dict)\[|\b(?:int|float) range\b|\bPath\b")
# A Python parameter name in the usage line: {run_dir}, [source], {run_dirs}...
PARAMETER_NAME = re.compile(r"[\[{][a-z][a-z0-9_]*[\]}]")
# The start of a command line: "-m nanopt train" is one command run through torchrun, not a second example.
COMMAND_LINE = re.compile(rf"(?<!-m )\bnanopt (?:{'|'.join(map(re.escape, COMMANDS))})\b")


def help_text(*args: str, width: int) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return result.output


def examples(text: str) -> list[str]:
    """The lines after the help's "Examples:" heading, which ends it."""
    lines = [line.strip(" │") for line in text.splitlines()]
    assert "Examples:" in lines, text
    return lines[lines.index("Examples:") + 1:]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", [*COMMANDS, None], ids=[*COMMANDS, "nanopt"])
def test_values_are_named_in_words(command: str | None, width: int):
    text = help_text(*([command] if command else []), width=width)
    shown = [line for line in text.splitlines() if PYTHON_TYPE.search(line)]
    assert not shown, "a Python type as a placeholder:\n" + "\n".join(shown)
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    assert not PARAMETER_NAME.search(usage), usage


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", COMMANDS)
def test_examples_stand_one_a_line(command: str, width: int):
    block = examples(help_text(command, width=width))
    starts = [line for line in block if line.startswith(f"nanopt {command} ")]
    assert starts, f"no example of nanopt {command} after Examples:"
    glued = [line for line in block if any(m.start() > 0 for m in COMMAND_LINE.finditer(line))]
    assert not glued, "an example that does not start its own line:\n" + "\n".join(glued)
