"""The rich Console every command prints through: text that came from a file cannot drive the terminal.

Run names, train.json values, dataset and checkpoint paths, tokenizer sources and generated samples reach tables,
notes and error lines. Each command escapes such values with rich.markup.escape where it mixes them with its own
markup; this console is the net under all of it:

- control characters (ESC, C1, bidi overrides, ...) become visible escapes (nanopt.untrusted_text.printable), both
  in the strings printed and in every segment rendered, so no value can erase lines or set the window title;
- a value that still reaches markup unescaped and is not valid markup (a closing tag such as `[/x]` in a
  directory name) is printed as it is, instead of a MarkupError traceback;
- no emoji codes: `:smile:` in a value stays text.

Its width is the terminal's, or COLUMNS; with neither (output to a log file or a pipe, as under nohup, SLURM or CI)
PIPED_WIDTH rather than rich's 80, which would wrap every wide table of a training log.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.errors import MarkupError
from rich.segment import Segment
from rich.text import Text

from nanopt.untrusted_text import printable

PIPED_WIDTH = 160  # columns when no terminal tells the width and COLUMNS is unset


class SafeConsole(Console):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"highlight": False, "emoji": False, **kwargs})
        if "width" not in kwargs and not os.environ.get("COLUMNS", "").strip().isdigit() and not _terminal_width():
            self.width = PIPED_WIDTH

    def render_str(self, text: str, **kwargs: Any) -> Text:
        # Escaped before rich's own clean-up, which drops some control characters silently (BEL, CR) and keeps ESC.
        text = printable(text, lines=True)
        try:
            return super().render_str(text, **kwargs)
        except MarkupError:
            return super().render_str(text, **{**kwargs, "markup": False})

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        # Every segment on its way out, renderables built without render_str included (Text objects, progress
        # columns). A control segment is rich's own cursor movement for a live display and stays as it is. rich has
        # rendered its output here since its first releases; tests/test_terminal.py shows it still does.
        return super()._render_buffer(
            segment if segment.control else Segment(printable(segment.text, lines=True), segment.style)
            for segment in buffer)


def _terminal_width() -> bool:
    """Whether a terminal gives rich its width: one of the standard streams is a terminal, as rich looks for."""
    for descriptor in (0, 1, 2):
        try:
            os.get_terminal_size(descriptor)
        except (OSError, ValueError):
            continue
        return True
    return False
