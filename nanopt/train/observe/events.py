"""What a training run tells the person watching it: a small observer protocol the CLI renders.

The library never prints or imports rich: it calls these methods on rank 0 (other ranks get `Silent`), and
nanopt.cli.display.train draws them as a live progress bar and log lines.
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainObserver(Protocol):
    def start(self, total_steps: int, step: int) -> None: ...

    def advance(self, step: int) -> None: ...

    def note(self, text: str) -> None: ...

    def log(self, record: dict[str, Any], total_steps: int) -> None: ...

    def data_repeats(self, record: dict[str, Any]) -> None:
        """The run will read its train split more than once: the `data_repeats` event of metrics.jsonl (split_tokens,
        split_sequences, seq_len, run_tokens, epochs), heard once per run, before its first step."""

    def evaluated(self, step: int, loss: float, seconds: float, share: float) -> None:
        """An in-loop evaluation: its loss, how long it took, and evaluation's share of the session's time so far
        (in steps and evaluation)."""

    def health(self, verdict: dict[str, Any]) -> None:
        """A health verdict (nanopt.train.health.verdicts), once per run: the `health` event of metrics.jsonl (step,
        verdict, message, advice)."""

    def stop(self) -> None: ...


class Silent:
    """An observer that shows nothing: every rank but 0, tests, and the measurements of find-batch and profile."""

    def start(self, total_steps: int, step: int) -> None:
        pass

    def advance(self, step: int) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def log(self, record: dict[str, Any], total_steps: int) -> None:
        pass

    def data_repeats(self, record: dict[str, Any]) -> None:
        pass

    def evaluated(self, step: int, loss: float, seconds: float, share: float) -> None:
        pass

    def health(self, verdict: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        pass
