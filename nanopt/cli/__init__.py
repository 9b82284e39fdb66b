"""Command-line interface. Importing this package registers every command on `app`."""

from nanopt.cli import commands as _commands  # noqa: F401  (registers the commands)
from nanopt.cli.app import app, main

__all__ = ["app", "main"]
