"""A run with no dataset yet: `nanopt import` writes train.json's `data` as DATA_PLACEHOLDER, since the imported
model's tokenizer is known but no corpus has been tokenized with it. Every command that reads the run's data
resolves `data` through RunConfig.data_dirs, which calls check_has_data: the placeholder is said for what it is,
with how to give a dataset, never looked up as a directory named "SET ME: ..." inside the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nanopt.errors import ConfigError
from nanopt.rundir import STEP_NAME, RunDir
from nanopt.untrusted_text import shell_word

DATA_PLACEHOLDER = "SET ME: a dataset made with this run's tokenizer (see _note)"
_TOKENIZER = "tokenizer.json"  # what a checkpoint carries (nanopt.train.checkpoint.TOKENIZER_FILE, a layer above)


def is_placeholder(data: Any) -> bool:
    """Whether train.json's `data` is still what `nanopt import` wrote in its place."""
    return isinstance(data, str) and data.strip() == DATA_PLACEHOLDER


def check_has_data(data: Any, run_dir: Path) -> None:
    """ConfigError, one line with the commands that give the run a dataset, when `data` is the placeholder."""
    if not is_placeholder(data):
        return
    tokenizer, out, run = shell_word(run_tokenizer(run_dir)), "data/NAME", shell_word(run_dir)
    raise ConfigError(f"{run_dir}: the run has no dataset yet (train.json's 'data' is still the placeholder "
                      "`nanopt import` wrote)",
                      f"tokenize a corpus with the run's tokenizer: `nanopt tokenize SOURCE --tokenizer {tokenizer} "
                      f"--out {out}`, then give it: `nanopt eval {run} --data {out}`, `nanopt train {run} --set "
                      f"data={out}` (or its path in train.json's \"data\"); `nanopt eval {run} --no-loss` samples "
                      "without one")


def run_tokenizer(run_dir: Path) -> Path:
    """The tokenizer.json the run's checkpoints carry (all the same one): the oldest checkpoint's that is there,
    else the imported step 0's."""
    run = RunDir(run_dir)
    try:
        steps = sorted(int(m.group(1)) for p in run.checkpoints.iterdir() if (m := STEP_NAME.fullmatch(p.name)))
        return next(path for step in steps if (path := run.step_dir(step) / _TOKENIZER).is_file())
    except (OSError, StopIteration):  # no checkpoints/ (moved, unreadable), or none that carries one
        return run.step_dir(0) / _TOKENIZER
