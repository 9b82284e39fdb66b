"""Errors a user can cause. Library code raises them; only the CLI turns them into exit status 2.

Each carries a message (what is wrong, naming the file and key where there is one) and a hint (what to do).
"""

from __future__ import annotations


class NanoptError(Exception):
    """Base of every user-facing error: printed as one line with a hint, exit status 2, no traceback."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        return f"{text}. Hint: {self.hint}" if self.hint else text


class ConfigError(NanoptError):
    """model.json / train.json / command-line options that are malformed or impossible."""


class DataError(NanoptError):
    """A dataset directory or corpus that is missing, empty, too small or inconsistent with the model."""


class CheckpointError(NanoptError):
    """A checkpoint that does not exist, is incomplete or corrupt, or cannot be written."""


class ResumeError(NanoptError):
    """Resuming a run whose settings changed in a way that would silently give a different run."""


class WritePathError(NanoptError):
    """A path nanopt would write or delete is a link, or not the kind of file that belongs there (nanopt.files)."""


class DistributedError(NanoptError):
    """A process-group failure: a rank died, timed out or disagreed."""
