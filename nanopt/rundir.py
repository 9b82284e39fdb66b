"""The run directory: every path nanopt reads or writes inside runs/NAME/, and nowhere else spelled out.

    runs/NAME/
      model.json  train.json          the run's configuration (written by a person)
      checkpoints/step-000600/        one checkpoint (see nanopt.train.checkpoint)
      checkpoints/latest, best        one-line pointer files naming a step directory
      metrics.jsonl  loss.png         what training measured (see nanopt.train.observe.metrics)
      eval.json                       the latest `nanopt eval` result (also inside the checkpoint it evaluated)
      eval_history.jsonl              every test-loss evaluation, one result a line (see nanopt.evaluate.history)
      holds/step-N.ID                 a checkpoint a reader is using: retention keeps it (nanopt.train.checkpoint.hold)
      find_batch.json  profile/       what `nanopt find-batch` and `nanopt profile` measured
      preflight.json                  what `nanopt preflight` measured and projected (see nanopt.plan.preflight_record)
      plan.json  prediction.json      what `nanopt plan` chose and why; what was predicted before the first step
      tensorboard/  wandb/            train.json's `tensorboard` / `wandb_project` logging (see
                                      nanopt.train.observe.sinks)
      on_exit.log                     the output of the train.json / --on-exit command, run after each session
      on_event.log  health.png        the output of the --on-event command; `nanopt eval --health`'s chart
      export/                         the default `nanopt export` destination
      previous/TIMESTAMP/             what a fresh start (`--resume none`) moved aside: the earlier checkpoints,
                                      metrics.jsonl, loss.png, eval.json, eval_history.jsonl and tensorboard/,
                                      never deleted by nanopt
      .lock                           held by the `nanopt train` that is writing this run (see nanopt.train.guard.lock)

Pure path arithmetic: nothing here reads or writes a file, so any module may import it. How nanopt writes these
paths (never through a link) is nanopt.files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MODEL_FILE = "model.json"
TRAIN_FILE = "train.json"
CHECKPOINTS = "checkpoints"
METRICS_FILE = "metrics.jsonl"
CHART_FILE = "loss.png"
EVAL_FILE = "eval.json"
EVAL_HISTORY_FILE = "eval_history.jsonl"
HOLDS_DIR = "holds"
FIND_BATCH_FILE = "find_batch.json"
PROFILE_DIR = "profile"
PREFLIGHT_FILE = "preflight.json"
PLAN_FILE = "plan.json"
PREDICTION_FILE = "prediction.json"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # W&B names its own folder: this is where it lands when given the run directory
EXIT_HOOK_LOG = "on_exit.log"
EVENT_HOOK_LOG = "on_event.log"
HEALTH_CHART_FILE = "health.png"
# rank-R.txt: every thread's stack when that rank stopped making progress (nanopt.train.guard.stall)
STALLS_DIR = "stalls"
EXPORT_DIR = "export"
LOCK_FILE = ".lock"
PREVIOUS_DIR = "previous"
POINTERS = ("latest", "best")
STEP_NAME = re.compile(r"step-(\d+)")  # checkpoints/step-N/, any number of digits
TMP_PREFIX = ".tmp-"  # checkpoints/.tmp-step-N/ (being written), .tmp-delete-step-N/ (being deleted); staged()


def temporary(path: Path) -> Path:
    """Where the next contents of a file nanopt replaces whole are written before they are renamed over it
    (nanopt.files.replacing): NAME.tmp beside it, so a reader never sees half a file."""
    return path.with_name(path.name + ".tmp")


def staged(path: Path) -> Path:
    """Where a new file nanopt creates is written before it is renamed to its name (nanopt.files.create_file):
    .tmp-NAME beside it, so the name never shows the file empty or half-written."""
    return path.with_name(TMP_PREFIX + path.name)


def is_checkpoint_entry(name: str) -> bool:
    """A name in checkpoints/ that training writes, renames or deletes: step-N/ and the .tmp-* directories."""
    return STEP_NAME.fullmatch(name) is not None or name.startswith(TMP_PREFIX)


def step_dir_name(step: int) -> str:
    """`step-000600`: six digits at least; the step itself (never the name's sort order) orders checkpoints."""
    return f"step-{step:06d}"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def model_json(self) -> Path:
        return self.root / MODEL_FILE

    @property
    def train_json(self) -> Path:
        return self.root / TRAIN_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def step_dir(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def chart(self) -> Path:
        return self.root / CHART_FILE

    @property
    def eval_json(self) -> Path:
        return self.root / EVAL_FILE

    @property
    def eval_history(self) -> Path:
        return self.root / EVAL_HISTORY_FILE

    @property
    def holds(self) -> Path:
        return self.root / HOLDS_DIR

    @property
    def find_batch_json(self) -> Path:
        return self.root / FIND_BATCH_FILE

    @property
    def preflight_json(self) -> Path:
        return self.root / PREFLIGHT_FILE

    @property
    def plan_json(self) -> Path:
        return self.root / PLAN_FILE

    @property
    def prediction_json(self) -> Path:
        return self.root / PREDICTION_FILE

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def wandb(self) -> Path:
        return self.root / WANDB_DIR

    @property
    def exit_hook_log(self) -> Path:
        return self.root / EXIT_HOOK_LOG

    @property
    def event_hook_log(self) -> Path:
        return self.root / EVENT_HOOK_LOG

    @property
    def health_chart(self) -> Path:
        return self.root / HEALTH_CHART_FILE

    @property
    def stalls(self) -> Path:
        return self.root / STALLS_DIR

    def stall_stacks(self, rank: int) -> Path:
        return self.stalls / f"rank-{rank}.txt"

    @property
    def profile_dir(self) -> Path:
        return self.root / PROFILE_DIR

    @property
    def export_dir(self) -> Path:
        return self.root / EXPORT_DIR

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def previous(self) -> Path:
        return self.root / PREVIOUS_DIR

    def written_files(self) -> list[Path]:
        """Every fixed file nanopt writes, appends to or deletes in the run, with the temporary of each it replaces
        whole: where a link, or anything but a regular file, is refused before the first write
        (nanopt.files.check_run_dir)."""
        replaced = [self.metrics, self.chart, self.eval_json, self.find_batch_json, self.preflight_json,
                    self.prediction_json, self.health_chart, *(self.checkpoints / name for name in POINTERS)]
        return [self.lock, self.exit_hook_log, self.event_hook_log, self.eval_history, *replaced,
                *(temporary(path) for path in replaced)]

    def written_dirs(self) -> list[Path]:
        """Every directory nanopt makes, writes into or deletes from in the run (checkpoints/ also holds the
        directories is_checkpoint_entry names, found by listing it)."""
        return [self.checkpoints, self.previous, self.profile_dir, self.tensorboard, self.wandb, self.holds,
                self.stalls]

    def training_outputs(self) -> list[Path]:
        """What training writes (and a fresh start moves aside), where it exists. TensorBoard's event files go too:
        the new run's steps would draw over the old ones. wandb/ stays: each session is its own W&B run."""
        return [p for p in (self.checkpoints, self.metrics, self.chart, self.eval_json, self.eval_history,
                            self.tensorboard) if p.exists()]
