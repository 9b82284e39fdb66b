"""Where else a run's metrics go: TensorBoard and Weights & Biases, fed the very records of metrics.jsonl.

nanopt.train.observe.metrics.MetricsLog.write is the one place every record passes (rank 0 only); it hands each record,
as written to metrics.jsonl, to the sinks here. metrics.jsonl stays the source of truth: a sink that fails (its
package broken, its directory unwritable, its service unreachable) is reported once through the observer and
dropped for the rest of the session, and training goes on. Sinks are cheap per record (TensorBoard's writer queues
events for a background thread; W&B hands them to its own service process) and flush at each evaluation and
checkpoint (the `phases` record that follows them) and at the end.

Both packages are optional extras (`pip install 'nanopt[tensorboard]'`, `'nanopt[wandb]'`) and imported only when
a run turns them on; a run that asks for one that is not installed is refused before any training.
"""

from __future__ import annotations

import importlib.util
import math
import netrc
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from nanopt.config import RunConfig
from nanopt.errors import ConfigError
from nanopt.rundir import RunDir

# Fields that identify a record rather than measure something: never charted.
_NOT_SCALARS = {"kind", "step", "time", "event", "session_start", "world_size"}


class Sink(Protocol):
    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def restart_after(self, step: int) -> None:
        """metrics.jsonl dropped the records after `step` (a resume): they will be written again."""

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record's numbers, named `kind/field` (`train/loss`, `eval/val_loss`, `phases/seconds/eval`,
    `event/loss_spike/zscore`); nested objects flatten with `/`. Strings, None and non-finite values are left
    out: the record in metrics.jsonl has them."""
    kind = record.get("kind", "record")
    prefix = f"event/{record.get('event', 'unknown')}" if kind == "event" else kind
    return dict(_flatten(prefix, {k: v for k, v in record.items() if k not in _NOT_SCALARS}))


def _flatten(prefix: str, value: Any) -> Iterable[tuple[str, float]]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flatten(f"{prefix}/{key}", inner)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield prefix, float(value)


def event_text(record: dict[str, Any]) -> str:
    """An event as one line: `loss_spike at step 120: loss=7.31, zscore=8.2`."""
    details = ", ".join(f"{k}={v}" for k, v in record.items() if k not in _NOT_SCALARS)
    return f"{record.get('event')} at step {record.get('step')}" + (f": {details}" if details else "")


class Sinks:
    """The sinks of one session; a sink that raises is reported once through `warn` and used no more."""

    def __init__(self, sinks: list[Sink], warn: Callable[[str], None]) -> None:
        self.active = list(sinks)
        self.warn = warn

    def write(self, record: dict[str, Any]) -> None:
        self._each(lambda sink: sink.write(record))

    def restart_after(self, step: int) -> None:
        self._each(lambda sink: sink.restart_after(step))

    def close(self) -> None:
        self._each(lambda sink: sink.close())
        self.active = []

    def _each(self, call: Callable[[Sink], None]) -> None:
        for sink in list(self.active):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001 - a logging failure must never end a paid-for run
                self.active.remove(sink)
                self.warn(f"{sink.name} logging stopped ({_first_line(exc)}); metrics.jsonl has every record")


class TensorBoardSink:
    """Scalars (and events as text) into runs/NAME/tensorboard/, each at its record's step and wall time."""

    name = "TensorBoard"

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # now, in setup: the import takes a second

        self.writer_class = SummaryWriter
        self.log_dir = log_dir
        self.writer: Any = None  # made at the first record, after a resume has said where it restarts
        self.purge_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        writer = self._writer()
        step, walltime = record.get("step"), record.get("time")
        for tag, value in scalars(record).items():
            writer.add_scalar(tag, value, global_step=step, walltime=walltime)
        if record.get("kind") == "event":
            writer.add_text("events", event_text(record), global_step=step, walltime=walltime)
        if record.get("kind") in ("eval", "phases"):  # after an evaluation or a checkpoint, and at the end
            writer.flush()

    def restart_after(self, step: int) -> None:
        """A new event file whose first event tells TensorBoard to drop the earlier files' points past `step`, as
        metrics.jsonl dropped them."""
        self.close()
        self.purge_step = step + 1

    def _writer(self) -> Any:
        if self.writer is None:
            self.writer = self.writer_class(str(self.log_dir), purge_step=self.purge_step)
            self.purge_step = None
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


class WandbSink:
    """One W&B run per training session, grouped by the run directory's name, its x axis the run's `step`. Started
    while the session is set up, so its start-up (seconds online) is never taken for training time."""

    name = "W&B"

    def __init__(self, run: RunConfig, mode: str | None) -> None:
        import wandb

        paths = RunDir(run.run_dir)
        self.run = wandb.init(project=run.train.wandb_project, name=paths.root.name, group=paths.root.name,
                              config=run.snapshot(), mode=mode,
                              dir=None if os.environ.get("WANDB_DIR") else str(paths.root), reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))  # nanopt's output stays its own
        # Against the run's own step, not W&B's call counter: a resume or a rollback logs earlier steps again.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, record: dict[str, Any]) -> None:
        data: dict[str, Any] = dict(scalars(record))
        if record.get("kind") == "event":
            data["event"] = event_text(record)
        if data and record.get("step") is not None:
            self.run.log({"step": record["step"], **data})

    def restart_after(self, step: int) -> None:
        pass  # each session is its own W&B run

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


# ----------------------------------------------------------------------------------------------------- building


def check_sink_packages(run: RunConfig) -> None:
    """Refuse, before any training, a run that turns on a sink whose package is not installed. On every rank, so
    all refuse together."""
    wanted = [("tensorboard", "tensorboard", run.train.tensorboard),
              ("wandb", "wandb_project", run.train.wandb_project is not None)]
    for package, key, on in wanted:  # each package is also the name of its nanopt extra
        if on and not _installed(package):
            raise ConfigError(f"{RunDir(run.run_dir).train_json}: key '{key}': {package} is not installed",
                              f"pip install 'nanopt[{package}]', or turn the key off")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked or half-removed (sys.modules entry of None)
        return False


def wandb_mode(run: RunConfig) -> tuple[str | None, str | None]:
    """The W&B mode and, when it falls back to offline, a note saying so. train.json's `wandb_mode` wins; then
    WANDB_MODE (W&B reads it itself); then online when an API key is at hand (WANDB_API_KEY or `wandb login`'s
    ~/.netrc entry), else offline: W&B would otherwise stop to ask for a key in the middle of setup."""
    if run.train.wandb_mode is not None:
        return run.train.wandb_mode, None
    if os.environ.get("WANDB_MODE"):
        return None, None
    if os.environ.get("WANDB_API_KEY") or _netrc_has(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")):
        return "online", None
    where = Path(os.environ["WANDB_DIR"]) / "wandb" if os.environ.get("WANDB_DIR") else RunDir(run.run_dir).wandb
    return "offline", (f"W&B: no API key (WANDB_API_KEY or `wandb login`), logging offline into {where}; "
                       "`wandb sync` uploads it later")


def _netrc_has(url: str) -> bool:
    host = urlparse(url).hostname or url
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def build_sinks(run: RunConfig, warn: Callable[[str], None]) -> Sinks:
    """The sinks train.json turns on (rank 0, after check_sink_packages), started now, while the session is set
    up. One that cannot start is a warning, not an error: the run trains, and metrics.jsonl has every record."""
    makers: list[tuple[str, Callable[[], Sink]]] = []
    if run.train.tensorboard:
        makers.append((TensorBoardSink.name, lambda: TensorBoardSink(RunDir(run.run_dir).tensorboard)))
    if run.train.wandb_project is not None:
        mode, note = wandb_mode(run)
        if note:
            warn(note)
        makers.append((WandbSink.name, lambda: WandbSink(run, mode)))
    sinks: list[Sink] = []
    for name, make in makers:
        try:
            sinks.append(make())
        except Exception as exc:  # noqa: BLE001 - W&B unreachable or refusing the key, say: train anyway
            warn(f"{name} logging not started ({_first_line(exc)}); metrics.jsonl has every record")
    return Sinks(sinks, warn)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
