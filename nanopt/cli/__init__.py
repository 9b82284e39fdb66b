"""Command-line interface. Importing this package registers every command on `app`.

Here, what every command shares: the Typer app (app), how --help reads (helptext), the console that keeps text from
files from driving the terminal (terminal), the torchrun launcher (launch) and its workers' errors (rank_errors).
The commands are in `commands`, one module each; their rendering in `display`.
"""

from nanopt.cli import commands as _commands  # noqa: F401  (registers the commands)
from nanopt.cli.app import app, main

__all__ = ["app", "main"]
