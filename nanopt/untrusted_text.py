"""Text nanopt shows a person that came from elsewhere: a run, checkpoint or dataset path, a train.json value, a
directory name, model output. Such text may come from someone else (docs/design.md, "The trust boundary"), so

- `shell_word`: a path or other word inside a command nanopt suggests is shell-quoted, so pasting the command runs
  nanopt on that path, never a `$(...)` in a directory name, and a space does not split it;
- `printable`: control characters become visible escapes before they reach a terminal, so a crafted value cannot
  erase earlier lines, set the window title or reorder what is shown (bidi overrides).

The bottom layer, beside nanopt.errors: library hints quote with it, the CLI escapes everything it prints with it.
"""

from __future__ import annotations

import re
import shlex

# C0 controls (ESC among them), DEL, C1 controls (0x9b is a one-byte CSI on some terminals), the bidi embeddings,
# overrides and isolates, and lone surrogates (a file name that is not UTF-8, decoded with surrogateescape: a
# UTF-8 terminal stream cannot even encode them).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_KEPT_IN_LINES = "\n\t"
_SHORT = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}  # as Python writes them


def shell_word(value: object) -> str:
    """`value` (a path, usually) as one word of a command a person may paste into a POSIX shell: unchanged when it
    is plain (runs/demo), else in single quotes."""
    return shlex.quote(str(value))


def printable(text: str, *, lines: bool = False) -> str:
    """`text` with every control character written as a visible escape (\\x1b, \\u202e, \\udcff). `lines` keeps
    newlines and tabs, for text that is shown as several lines (a generated sample)."""
    return _CONTROL.sub(lambda match: _escape(match.group(), lines), text)


def _escape(char: str, lines: bool) -> str:
    if lines and char in _KEPT_IN_LINES:
        return char
    code = ord(char)
    return _SHORT.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
