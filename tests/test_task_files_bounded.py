"""`nanopt eval RUN --tasks ... --task-data DIR` reads DIR/TASK.jsonl (or a save_to_disk folder DIR/TASK) as a
stranger's files, in bounded memory and time:

- a line far longer than any benchmark record is refused by its line number without being held (the process's
  peak memory, measured, stays near that of scoring a small file);
- records that parse to more than MAX_KEPT_BYTES, or whose prompts (a context repeated per choice) total more
  than MAX_PROMPT_CHARS, are refused before they cost more;
- a line of brackets is not a regex's quadratic time; a named pipe in a saved folder is not a hang;
- a record with any JSON value in any field (non-finite numbers, huge integers, lone surrogates, lists and
  objects) is scored or refused in one line, exit 2; never a traceback.

Derandomized; NANOPT_FUZZ_EXAMPLES asks for more examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from clihelp import REPO, assert_user_error, run_cli
from faulthelp import Launcher, tree_digest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jsonhelp import field_paths
from taskdata import RECORDS, write_task_data
from trainhelp import HIDE_CUDA, make_run

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "20"))
PROPERTY = settings(derandomize=True, database=None, deadline=timedelta(seconds=60), max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HUGE_LINE_MB = 300
# What the refused command may take beyond scoring a small file: a third of the line it refuses, so holding the
# line even once fails the test, yet far above the noise of two runs of the same command (a few MB).
EXTRA_RSS_BYTES = 100 << 20
PIPE_GUARD_S = 120  # a blocked open never returns: the timeout ends it, and the test fails
BRACKETS_S = 30  # the whole command takes a few seconds; with the harness's regex, over two minutes
# The child's peak resident memory (KiB on Linux), written by a parent whose only child is the command.
MEASURE = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[2:]).returncode; "
           "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
           "sys.exit(code)")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    run = make_run(tmp_path_factory.mktemp("task-runs"), tiny_dataset, "run", max_steps=2, eval_interval=0,
                   checkpoint_interval=2)
    launcher.train(run)
    return run


def eval_args(run: Path, task: str, task_data: Path) -> list[object]:
    """Scores one task and nothing else: --no-loss writes no eval.json, so a refused file leaves the run as it was."""
    return ["eval", run, "--tasks", task, "--task-data", task_data, "--no-loss", "--no-samples", "--json"]


def measured(args: list[object], tmp_path: Path) -> tuple[subprocess.CompletedProcess, int]:
    """The CLI in a subprocess, as a user runs it, and its peak resident memory in bytes."""
    rss = tmp_path / "maxrss"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **HIDE_CUDA}
    result = subprocess.run([sys.executable, "-c", MEASURE, rss, sys.executable, "-m", "nanopt", *map(str, args)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return result, int(rss.read_text()) * 1024


def write_huge_line(path: Path, megabytes: int) -> None:
    """A lambada record on line 1, then one record whose text is `megabytes` MB long: written a MB at a time."""
    chunk = b"a" * (1 << 20)
    with path.open("wb") as f:
        f.write(json.dumps(RECORDS["lambada_openai"][0]).encode() + b"\n" + b'{"text": "')
        for _ in range(megabytes):
            f.write(chunk)
        f.write(b'"}\n')


@pytest.mark.slow  # two processes that import torch, and 300 MB written: about 15 s
def test_a_300_mb_line_is_refused_by_its_number_without_being_held(trained: Path, tmp_path: Path):
    small = write_task_data(tmp_path / "small")
    baseline, baseline_rss = measured(eval_args(trained, "lambada_openai", small), tmp_path)
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    huge = tmp_path / "huge"
    huge.mkdir()
    write_huge_line(huge / "lambada_openai.jsonl", HUGE_LINE_MB)
    before = tree_digest(trained)
    try:
        refused, refused_rss = measured(eval_args(trained, "lambada_openai", huge), tmp_path)
    finally:
        (huge / "lambada_openai.jsonl").unlink()  # 300 MB: not left for pytest's kept temporary directories
    print(f"peak RSS: {baseline_rss >> 20} MiB scoring a small file, {refused_rss >> 20} MiB refusing the line")
    assert refused_rss < baseline_rss + EXTRA_RSS_BYTES, (refused_rss >> 20, baseline_rss >> 20)
    assert_user_error(refused, "lambada_openai.jsonl line 2", "longer than 1 MiB")
    assert tree_digest(trained) == before


def test_a_line_of_brackets_is_scored_in_linear_time(trained: Path, tmp_path: Path, cli_in_process):
    """HellaSwag's preprocessing drops [bracketed] spans; the harness's regex for it is quadratic on a line of '['
    with no ']': minutes for this record (hours for one of a MiB), a second or two in linear time."""
    record = {**RECORDS["hellaswag"][0], "ctx_a": "[" * 100_000}
    (tmp_path / "hellaswag.jsonl").write_text(json.dumps(record) + "\n")
    started = time.monotonic()
    result = cli_in_process(*eval_args(trained, "hellaswag", tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["tasks"]["hellaswag"]["n"] == 1
    assert time.monotonic() - started < BRACKETS_S


@pytest.mark.parametrize("task, field, raw, fragment", [
    ("piqa", "label", "Infinity", "record 1 does not fit piqa's schema"),
    ("piqa", "label", "-Infinity", "record 1 does not fit piqa's schema"),
    ("hellaswag", "label", "1e400", "record 1 does not fit hellaswag's schema"),
    ("winogrande", "answer", '"3"', "answer '3' is not \"1\" or \"2\""),
    ("lambada_openai", "text", '"a \\ud800 b"', "lone surrogate"),
    ("arc_easy", "choices", '{"text": ["x", "\\udfff"], "label": ["A", "B"]}', "lone surrogate"),
])
def test_a_value_no_record_holds_is_one_line(task: str, field: str, raw: str, fragment: str, trained: Path,
                                            tmp_path: Path, cli_in_process):
    (tmp_path / f"{task}.jsonl").write_text(with_raw(RECORDS[task][0], (field,), raw) + "\n")
    assert_user_error(cli_in_process(*eval_args(trained, task, tmp_path)), f"{task}.jsonl", fragment)


def test_choices_that_repeat_a_long_context_are_refused_before_scoring(trained: Path, tmp_path: Path,
                                                                      cli_in_process):
    """Each choice is scored after its own copy of the context: 80 one-letter endings of a 900 KB context are 72
    million characters to tokenize (some 3.5 GB), more than any benchmark's prompts (MAX_PROMPT_CHARS)."""
    record = {**RECORDS["hellaswag"][0], "ctx_a": "word " * 180_000, "endings": ["x"] * 80}
    (tmp_path / "hellaswag.jsonl").write_text(json.dumps(record) + "\n")
    assert_user_error(cli_in_process(*eval_args(trained, "hellaswag", tmp_path)), "hellaswag.jsonl",
                      "prompts of its first 1 records total more than 67,108,864 characters", "--limit")


@pytest.mark.slow  # 120 MB of short strings parsed and measured, in a process that imports torch: about 20 s
def test_records_that_parse_to_more_than_a_gib_are_refused(trained: Path, tmp_path: Path):
    """Each line is under the record cap and a valid piqa record, but carries a field of 200,000 two-letter
    strings, which parse to some 12 times their text: the records kept are measured, and refused past
    MAX_KEPT_BYTES before the process holds much more."""
    junk = json.dumps(["ab"] * 200_000, separators=(",", ":"))
    line = json.dumps(RECORDS["piqa"][0])[:-1] + f', "junk": {junk}}}\n'
    (tmp_path / "piqa.jsonl").write_text(line * 120)
    try:
        result, rss = measured(eval_args(trained, "piqa", tmp_path), tmp_path)
    finally:
        (tmp_path / "piqa.jsonl").unlink()
    assert_user_error(result, "piqa.jsonl: its first", "records take more than 1024 MiB in memory", "--limit")
    print(f"peak RSS refusing records past the kept budget: {rss >> 20} MiB")
    assert rss < 2 << 30, rss >> 20


def test_a_save_to_disk_folder_is_read_as_a_jsonl_is(trained: Path, tmp_path: Path, cli_in_process):
    datasets = pytest.importorskip("datasets")
    rows = [dict(r, label=float(r["label"])) for r in RECORDS["piqa"]]
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "piqa")
    scored = cli_in_process(*eval_args(trained, "piqa", tmp_path), "--limit", "1")
    assert scored.returncode == 0, scored.stderr
    assert json.loads(scored.stdout)["tasks"]["piqa"]["n"] == 1
    rows[0]["label"] = float("inf")
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "bad" / "piqa")
    assert_user_error(cli_in_process(*eval_args(trained, "piqa", tmp_path / "bad")), "piqa: record 1 does not fit")


def test_a_named_pipe_in_a_save_to_disk_folder_is_one_line_not_a_hang(trained: Path, tmp_path: Path):
    """Its Arrow file a named pipe: `datasets` would open it and wait forever (in C, where no signal reaches), so
    the command runs in a subprocess that a timeout ends."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(RECORDS["piqa"]).save_to_disk(tmp_path / "piqa")
    [arrow] = (tmp_path / "piqa").glob("*.arrow")
    arrow.unlink()
    os.mkfifo(arrow)
    assert_user_error(run_cli(*eval_args(trained, "piqa", tmp_path), env=HIDE_CUDA, timeout=PIPE_GUARD_S),
                      f"{arrow.name}: is a named pipe")


# ------------------------------------------------------------------------------------ any value in any field

# JSON text of values no record holds, some of which json.dumps cannot write (numbers past a float or past Python's
# int limit, lone surrogates), and a marker for a field left out.
JUNK = ["Infinity", "-Infinity", "NaN", "1e400", "-1e400", "9" * 4000, "9" * 5000, "-0.0", "2.5", str(2**70),
        '"\\ud800"', '"\\udfff x"', '"\\u0000"', '"\\u202e"', '"' + "[" * 5000 + '"', '"_"', '""', "[]", "{}",
        '[" x"]', '["a", "b", "c", "d", "e"]', "[" * 80 + "]" * 80, '{"text": ["a"], "label": ["A"]}']
DELETE = "<delete>"
PLACEHOLDER = "\x00junk\x00"


def json_values() -> st.SearchStrategy[str]:
    """JSON text: the extremes above, or any value json.dumps writes (NaN and infinities among its floats)."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
    nested = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=6), inner, max_size=3), max_leaves=8)
    return st.one_of(st.sampled_from(JUNK), nested.map(json.dumps), st.just(DELETE))


def with_raw(record: Any, path: tuple, raw: str) -> str:
    """The record as a JSON line with the value at `path` replaced by the JSON text `raw` (or left out)."""
    def replaced(value: Any, rest: tuple) -> Any:
        if not rest:
            return PLACEHOLDER
        copy = dict(value) if isinstance(value, dict) else list(value)
        if raw == DELETE and len(rest) == 1:
            del copy[rest[0]]
        else:
            copy[rest[0]] = replaced(value[rest[0]], rest[1:])
        return copy

    return json.dumps(replaced(record, path)).replace(json.dumps(PLACEHOLDER), raw)


@pytest.mark.parametrize("task", sorted(RECORDS))
@PROPERTY
@given(data=st.data())
def test_any_json_value_in_any_field_is_scored_or_one_line(task: str, data: st.DataObject, trained: Path,
                                                           tmp_path_factory, cli_in_process):
    record = RECORDS[task][0]
    path = data.draw(st.sampled_from(list(field_paths(record))), label="field")
    line = with_raw(record, path, data.draw(json_values(), label="value"))
    task_data = tmp_path_factory.mktemp("task-data")
    (task_data / f"{task}.jsonl").write_text(line + "\n")
    result = cli_in_process(*eval_args(trained, task, task_data))
    event("scored" if result.returncode == 0 else "refused")
    if result.returncode == 0:
        assert json.loads(result.stdout)["tasks"][task]["n"] == 1
    else:
        assert_user_error(result, f"{task}.jsonl")
