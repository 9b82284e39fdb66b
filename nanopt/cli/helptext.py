"""How every command's --help reads: values named in words, examples one a line, options in panels by job.

Each option names its value with `metavar`, in one convention: an upper-case word for what to give (RUN, DIR, FILE,
N, SIZE, SECONDS, USD, KEY=VALUE, HOST:PORT, ...), or the choices themselves (best|max) where there are a few.
Typer would otherwise show the Python type (`<path>`, `<list[str]>`, `<int range>`), and `<bool>` even for a flag,
which takes no value; the command class here shows nothing there for flags, and an argument's name alone.

The epilog is markdown (the app's rich_markup_mode), which joins consecutive lines into one paragraph: examples
go in a code block, which keeps them one a line, at the end of the help where they are easy to find.
"""

from __future__ import annotations

import textwrap
from typing import Any

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

# Panel names shared by several commands, so the same options sit under the same heading everywhere.
DEVICES_PANEL = "Devices and nodes"


class _NamedArgument(TyperArgument):
    """An argument shown by its metavar only: `RUN`, not `RUN <path>`."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def _in_words(params: list[Any]) -> list[Any]:
    for param in params:
        if isinstance(param, TyperArgument) and param.metavar is not None:
            param.__class__ = _NamedArgument  # Typer makes its parameters itself: their class cannot be chosen
        elif getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""  # --json, --help: nothing to type after them
    return params


class HelpCommand(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _in_words(super().get_params(ctx))


class HelpGroup(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _in_words(super().get_params(ctx))


class App(typer.Typer):
    """typer.Typer whose commands all use HelpCommand, so a new command reads the same without asking."""

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(name, cls=cls or HelpCommand, **kwargs)


def epilog(about: str, examples: str) -> str:
    """A command's epilog: what more there is to know (markdown paragraphs), then its examples in a code block.

    `examples` holds one command line a line; an indented line (a comment) belongs to the example above it. A blank
    line parts the examples, as a terminal narrower than the longest one wraps it onto the next line.
    """
    shown: list[str] = []
    for line in textwrap.dedent(examples).strip().splitlines():
        if line.strip():
            shown += [line.rstrip()] if line[0].isspace() or not shown else ["", line.rstrip()]
    block = "\n".join(["```sh", *shown, "```"])
    return "\n\n".join(part for part in (textwrap.dedent(about).strip(), "Examples:\n" + block) if part)
