"""The Typer application and what every command shares: error handling, --set, --json output.

Commands live one per module in nanopt.cli.commands; each parses its options, calls one library function and
renders the result (nanopt.cli.display). Torch and other heavy libraries are imported inside the command functions
only, so `nanopt --help` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from nanopt.cli.helptext import App, HelpGroup
from nanopt.cli.rank_errors import hand_to_launcher
from nanopt.cli.terminal import SafeConsole
from nanopt.errors import DistributedError, NanoptError
from nanopt.runtime import ranks
from nanopt.untrusted_text import printable

app = App(
    name="nanopt",
    cls=HelpGroup,
    help="Pretrain decoder-only language models with PyTorch: plan from a budget, estimate, tokenize, find-batch, "
         "profile, preflight, train, eval, export, and import from transformers.\n\n"
         "Quick start: `make demo` (CPU, built-in corpus), or see README.md for a GPU run.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
)

SET_HELP = ("Override a train.json value for this invocation only, e.g. --set learning_rate=3e-4 (repeatable). "
            "Setting train_tokens replaces train.json's max_steps, and the reverse: the budget is one or the other.")


def _print_version(wanted: bool) -> None:
    if wanted:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("nanopt")
        except PackageNotFoundError:  # imported from a source tree that was never installed
            text = "unknown (not installed: run `make install`)"
        sys.stdout.write(f"nanopt {text}\n")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                          help="Print nanopt's version and exit.")) -> None:
    """Options of `nanopt` itself, before the command (the app's help text above describes it)."""


def console(stderr: bool = False) -> SafeConsole:
    """Human output goes to stdout; progress bars and logs to stderr so `--json` stdout stays parseable. Text from
    files cannot drive the terminal through it (nanopt.cli.terminal)."""
    return SafeConsole(stderr=stderr)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def load_run_config(run_dir: Path, sets: list[str] | None, options: dict[str, Any] | None = None):
    """The run's configs with `--set` pairs applied, then the command's own options for train.json keys (such as
    --price-per-hour), those that were given (not None)."""
    from nanopt.config import load_run
    from nanopt.parsing import parse_overrides

    given = {key: value for key, value in (options or {}).items() if value is not None}
    return load_run(run_dir, {**parse_overrides(sets or []), **given})


@dataclass(frozen=True)
class Invocation:
    """What a command knows of how it was started (Typer's context object, `ctx.obj`)."""

    started: float  # Unix time: when this process started, for a command line; when main() was called, otherwise


def _started(argv: list[str] | None) -> float:
    """A command started as a process (argv None: the command line) is billed from the process start, imports
    included; a call from Python (tests, a notebook) from now, not from whenever its process began."""
    if argv is None:
        from nanopt.train.observe.phases import process_start_time

        return process_start_time()
    return time.time()


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; a user error prints one line with its hint and exits 2, without a traceback.

    Each branch leaves from inside its handler: the exception's traceback still holds the training session there,
    and freeing it is what can hang a torchrun worker (see `_leave`).
    """
    invocation = Invocation(started=_started(argv))
    try:
        # Not standalone: Typer returns the exit code of --help and typer.Exit, and raises its usage errors here,
        # where they become one line like every other mistake instead of a usage block and a panel.
        with quiet_libraries():
            code = app(args=argv, prog_name="nanopt", standalone_mode=False, obj=invocation)
    except SystemExit as exc:  # sys.exit in a command (the torchrun launcher)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        _leave(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    except NanoptError as exc:
        _report(exc)
        _leave(2)
    except _usage_errors() as exc:  # a value Typer cannot parse, an unknown option, a missing argument
        if type(exc).__name__ != "NoArgsIsHelpError":  # `nanopt` alone: the help is already printed
            _report(_usage_error(exc))
        _leave(exc.exit_code)
    except KeyboardInterrupt:
        console(stderr=True).print("interrupted")
        _leave(130)
    except BaseException as exc:  # a crash: a bug in nanopt or a library (DCP's CheckpointException is no Exception)
        if ranks().world_size == 1:
            raise  # Python's own report: the traceback and status 1
        _report_crash(exc)
        _leave(1)
    _leave(code if isinstance(code, int) else 0)


def _report_crash(exc: BaseException) -> None:
    """A torchrun worker's crash: its traceback, then its one line for nanopt's launcher, which names the rank and
    exits 1 (the ranks that lose contact because of it are not news); under a plain torchrun, the traceback alone."""
    import traceback

    traceback.print_exc()
    text = str(exc).strip().splitlines()
    line = (f"crashed with {type(exc).__name__}{': ' + text[0][:300] if text else ''} (the traceback is above). "
            "Hint: a bug, not a setting: complete checkpoints are kept, run the same command to resume; report the "
            "traceback if it happens again")
    hand_to_launcher(ranks().rank, line, lost_contact=False, crashed=True)


# What the libraries under nanopt print of their own accord: the Hugging Face hub's retry warnings, `datasets`' logged
# read errors, transformers' notices, the torch profiler's (kineto) `USDT: profiler_start` lines, torch.distributed's
# C++ socket warnings. nanopt says what went wrong in its own one line; theirs would only come before it. Each is set
# through the variable the library itself reads when it starts (every library nanopt uses is imported inside a
# command, after this), and a variable the person set is left as it is: that is how to see a library's log again.
QUIET_LIBRARY_ENV = {"HF_HUB_VERBOSITY": "critical", "DATASETS_VERBOSITY": "critical",
                     "TRANSFORMERS_VERBOSITY": "critical", "KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}
# The Python loggers behind the first three, for a library that was imported before (a test, an embedding program).
QUIET_LOGGERS = {"HF_HUB_VERBOSITY": "huggingface_hub", "DATASETS_VERBOSITY": "datasets",
                 "TRANSFORMERS_VERBOSITY": "transformers"}


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For one nanopt command: the libraries' own log lines and Python warnings off, unless the person asked for them
    (the variables above, or -W / PYTHONWARNINGS for warnings); everything as it was afterwards. The environment
    reaches the torchrun workers and trial processes a command starts."""
    chosen = {name: value for name, value in QUIET_LIBRARY_ENV.items() if name not in os.environ}
    loggers = {logging.getLogger(QUIET_LOGGERS[name]): logging.getLogger(QUIET_LOGGERS[name]).level
               for name in chosen if name in QUIET_LOGGERS}
    os.environ.update(chosen)
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            if not sys.warnoptions:  # torch's and the others' warnings are for their developers, not nanopt's users
                warnings.simplefilter("ignore")
            yield
    finally:
        for name in chosen:
            os.environ.pop(name, None)
        for logger, level in loggers.items():
            logger.setLevel(level)


def _report(exc: NanoptError) -> None:
    """One line on stderr. Under nanopt's own launcher a rank hands its line to the launcher, which prints each
    distinct error once with the rank that met it; under a plain torchrun every rank prints its own (an error
    only rank 1 meets must not go unsaid), except that the ranks a failure cut off from rank 0 leave the report
    of lost contact to rank 0."""
    here = ranks()
    if here.world_size > 1 and hand_to_launcher(here.rank, exc.one_line(), isinstance(exc, DistributedError)):
        return
    if here.rank and isinstance(exc, DistributedError):
        return
    prefix = f"rank {here.rank}: " if here.rank else ""
    # printable: the message names files and values from them; a newline or ESC in one stays on this one line.
    console(stderr=True).print(f"[bold red]error:[/] {escape(printable(prefix + exc.one_line()))}", soft_wrap=True)


def _usage_errors() -> tuple[type[Exception], ...]:
    """Typer's own usage errors (typer >= 0.20 carries its own parser) and click's (older typer is built on it)."""
    kinds: list[type[Exception]] = [typer.TyperException] if hasattr(typer, "TyperException") else []
    try:
        from click.exceptions import ClickException

        kinds.append(ClickException)
    except ImportError:
        pass
    return tuple(kinds)


def _usage_error(exc: Exception) -> NanoptError:
    """Typer's message on one line, with the command's --help as the hint."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "nanopt"
    return NanoptError(" ".join(exc.format_message().split()), f"see `{command} --help`")


def _leave(code: int) -> None:
    """Exit; a torchrun worker leaves without running destructors (os._exit).

    A gloo process group's destructor can block forever joining a thread that needs the GIL it holds (see
    nanopt.train.loop). By now every checkpoint, metric and result is written and closed, so skipping the
    interpreter's clean-up loses nothing; only the streams need flushing.
    """
    if ranks().world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
