"""`nanopt eval --harness TASKS`: lm-evaluation-harness itself, run on the checkpoint exported as a transformers
directory, so a user sees the harness's own numbers beside nanopt's (the optional `harness` extra:
`pip install "nanopt[harness]"`).

The harness scores its `hf` model in fp32 with `lm_eval.simple_evaluate`, on the same tasks by the same names.
With a --task-data folder, each task is the harness's own task file (`include:`) with only its dataset replaced
by the local TASK.jsonl, as the differential test (tests/test_tasks_harness.py) runs it. Its results are turned
into nanopt's per-task layout ({"acc": {"value", "stderr"}, "acc_norm": ..., "perplexity": ..., "n": ...}).

The export needs nanopt.export, a layer beside this one: the CLI hands it in (HarnessOptions.export).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError, DataError
from nanopt.evaluate.tasks.sources import check_jsonl
from nanopt.files import write_file
from nanopt.untrusted_text import printable

INSTALL = 'pip install "nanopt[harness]"'
# Each task's file in lm_eval/tasks/ (0.4.x), included by a local task that reads --task-data's TASK.jsonl.
HARNESS_FILES = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml",
                 "arc_challenge": "arc/arc_challenge.yaml", "piqa": "piqa/piqa.yaml",
                 "lambada_openai": "lambada/lambada_openai.yaml", "winogrande": "winogrande/default.yaml"}
LOCAL_PREFIX = "local_"
# The harness's metric names and how nanopt's table names them; "n" comes from its sample counts.
METRICS = ("acc", "acc_norm", "perplexity")


@dataclass(frozen=True)
class HarnessOptions:
    names: tuple[str, ...]
    limit: int | None = None
    task_data: Path | None = None  # DIR/TASK.jsonl instead of the hub
    # Writes a TrainedModel as a transformers directory at the given path (nanopt.export, from the CLI).
    export: Callable[[Any, Path], Any] | None = None

    def settings(self) -> dict[str, Any]:
        """What determines the harness's numbers (part of eval.json's reuse key)."""
        return {"names": list(self.names), "limit": self.limit,
                "task_data": None if self.task_data is None else str(self.task_data)}


def require_harness() -> None:
    """ConfigError (one line, exit 2) unless lm-evaluation-harness can be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("--harness runs lm-evaluation-harness, which is not installed", INSTALL) from None


def check_task_data(opts: HarnessOptions) -> None:
    """The harness reads --task-data's TASK.jsonl files (not save_to_disk folders) itself: each must be a file
    that nanopt's own reader would take (regular, capped, a line at a time, each line plain JSON)."""
    if opts.task_data is None:
        return
    for name in opts.names:
        path = Path(opts.task_data) / f"{name}.jsonl"
        if not path.is_file():
            raise DataError(f"{path}: task file not found (--harness reads TASK.jsonl files)",
                            "pass --task-data DIR holding TASK.jsonl per task, one record a line in the hub "
                            "dataset's schema")
        check_jsonl(path)


def run_harness(trained: Any, opts: HarnessOptions, device: str, batch_size: int) -> dict[str, Any]:
    """{"harness": {task: metrics}, "harness_seconds": s}: the checkpoint exported to a temporary directory and
    scored by lm_eval.simple_evaluate on its `hf` model."""
    require_harness()
    check_task_data(opts)
    assert opts.export is not None, "the CLI hands in nanopt.export"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nanopt-harness-") as tmp:
        model_dir = Path(tmp) / "model"
        opts.export(trained, model_dir)
        raw = _simple_evaluate(model_dir, opts, Path(tmp), device, batch_size)
    return {"harness": harness_metrics(raw, opts.names, local=opts.task_data is not None),
            "harness_seconds": time.perf_counter() - started}


def _simple_evaluate(model_dir: Path, opts: HarnessOptions, tmp: Path, device: str, batch_size: int) -> Any:
    import lm_eval
    from lm_eval.tasks import TaskManager

    if opts.task_data is None:
        tasks, manager = list(opts.names), TaskManager()
    else:
        yaml_dir = tmp / "tasks"
        yaml_dir.mkdir()
        write_local_tasks(yaml_dir, Path(lm_eval.__file__).parent / "tasks", opts)
        tasks, manager = [LOCAL_PREFIX + n for n in opts.names], TaskManager(include_path=str(yaml_dir))
    try:  # the harness's progress bars and prints go to stderr: stdout stays nanopt's own (--json)
        with contextlib.redirect_stdout(sys.stderr):
            return lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32",
                                           tasks=tasks, device=device, batch_size=batch_size,
                                           limit=opts.limit, task_manager=manager, log_samples=False)
    except Exception as exc:  # no network for the hub, a task the harness cannot build: one line, never a traceback
        reason = printable(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:200]
        raise DataError(f"lm-evaluation-harness failed on {', '.join(opts.names)}: {reason}",
                        "check the network (the harness loads the tasks from the hub), or pass --task-data DIR "
                        "holding TASK.jsonl per task") from None


def write_local_tasks(yaml_dir: Path, harness_tasks: Path, opts: HarnessOptions) -> None:
    """local_TASK.yaml per task: the harness's own task file with its dataset replaced by DIR/TASK.jsonl (every
    split the harness may read points at it). Paths are JSON strings, which YAML reads as they are."""
    for name in opts.names:
        data = json.dumps(str(Path(opts.task_data or ".").resolve() / f"{name}.jsonl"))
        splits = "".join(f"    {split}: {data}\n" for split in ("train", "validation", "test"))
        write_file(yaml_dir / f"{LOCAL_PREFIX}{name}.yaml",
                   f"include: {json.dumps(str(harness_tasks / HARNESS_FILES[name]))}\n"
                   f"task: {LOCAL_PREFIX}{name}\ndataset_path: json\ndataset_name: null\n"
                   f"dataset_kwargs:\n  data_files:\n{splits}")


def harness_metrics(raw: dict[str, Any], names: tuple[str, ...], local: bool) -> dict[str, Any]:
    """simple_evaluate's results in nanopt's per-task layout (values as fractions, as nanopt's are)."""
    out = {}
    for name in names:
        key = LOCAL_PREFIX + name if local else name
        result, counts = raw["results"][key], raw.get("n-samples", {}).get(key, {})
        task: dict[str, Any] = {"n": counts.get("effective")}
        for metric in METRICS:
            value = result.get(f"{metric},none")
            if value is None:
                continue
            stderr = result.get(f"{metric}_stderr,none")
            stderr = stderr if isinstance(stderr, (int, float)) else None  # "N/A" for a single example
            task[metric] = value if metric == "perplexity" else {"value": value, "stderr": stderr}
        out[name] = task
    return out
