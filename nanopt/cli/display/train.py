"""The live view of a training run: a rich progress bar with the latest numbers, and log lines.

It implements nanopt.train.observe.events.TrainObserver; the library calls it on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from nanopt.cli.display import format as fmt
from nanopt.cli.display.mixture import live_sources
from nanopt.cli.terminal import SafeConsole
from nanopt.untrusted_text import printable


class Display:
    def __init__(self, live: bool = True, on_health: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.console = SafeConsole(stderr=True)
        self.on_health = on_health  # the --on-event command's runner
        self.live = live and self.console.is_terminal
        self.progress: Progress | None = None
        self.task = None
        self.last_eval = "-"

    def start(self, total_steps: int, step: int) -> None:
        if not self.live:
            return
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=self.console, transient=False)
        self.progress.start()
        self.task = self.progress.add_task("", total=total_steps, completed=step)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def note(self, text: str) -> None:
        # One line each: a note may name a path or quote a value from train.json.
        self.console.print(printable(text), markup=False, soft_wrap=True)

    def log(self, r: dict[str, Any], total_steps: int) -> None:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else (r.get("mfu_note") or "-")
        epoch = f"  epoch {r['epoch']:.2f}" if r["epoch"] > 1 else ""  # only once the run reads data again
        line = (f"step {r['step']}/{total_steps}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad {r['grad_norm']:.3f}  "
                f"{r['tokens_per_s']:,.0f} tok/s  MFU {mfu}  val {self.last_eval}{epoch}{live_sources(r)}  {_bill(r)}")
        self.console.print(line, markup=False, soft_wrap=True)
        if self.progress is not None:
            self.progress.update(self.task, completed=r["step"],
                                 description=f"loss {r['loss']:.3f} | {r['tokens_per_s']:,.0f} tok/s | MFU {mfu} | "
                                             f"val {self.last_eval}{' |' + epoch if epoch else ''} | "
                                             f"{_money(r) or 'no price'}")

    def data_repeats(self, r: dict[str, Any]) -> None:
        self.console.print(f"warning: data repeats: the run reads {fmt.count(r['run_tokens'])} tokens from a train "
                           f"split of {fmt.count(r['split_tokens'])} tokens ({r['split_sequences']:,} sequences of "
                           f"{r['seq_len']:,}): {r['epochs']:.2f} epochs, each in a fresh order",
                           style="yellow", markup=False, soft_wrap=True, highlight=False)

    def health(self, verdict: dict[str, Any]) -> None:
        """A health verdict, once per run: on its own line above the live bar, then the --on-event command."""
        self.console.print(f"warning: step {verdict['step']}: health: {verdict['verdict']}: {verdict['message']}; "
                           f"{verdict['advice']}", style="yellow", markup=False, soft_wrap=True, highlight=False)
        if self.on_health is not None:
            self.on_health(verdict)

    def evaluated(self, step: int, loss: float, seconds: float, share: float) -> None:
        self.last_eval = f"{loss:.4f}"
        self.note(f"step {step}: val loss {loss:.4f} ({fmt.duration(seconds)}; evaluation is {share:.1%} of this "
                  "session's step and evaluation time)")


def _money(r: dict[str, Any]) -> str:
    """`$1.20 spent, $3.40 to finish`, or '' without a price."""
    if r.get("spent_usd") is None or r.get("to_finish_usd") is None:
        return ""
    return f"{fmt.money(r['spent_usd'])} spent, {fmt.money(r['to_finish_usd'])} to finish"


def _bill(r: dict[str, Any]) -> str:
    """The log line's tail: time (and money, given a price) so far and to finish."""
    if r.get("eta_s") is None:
        return ""
    money = _money(r)
    return f"elapsed {fmt.duration(r['elapsed_s'])}  ETA {fmt.duration(r['eta_s'])}" + (f"  {money}" if money else "")
