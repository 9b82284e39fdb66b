"""A dataset or a run directory from someone else: reading one never blocks, never gives a traceback, and every
number read from it is range-checked where it is read (SECURITY.md; the reading side of
docs/design.md's trust boundary).

- A property test puts wrong types, 0, negatives, NaN, infinities, 2**63, 2**70, numbers of 4,000 and 5,000
  digits, long strings, paths out of the dataset and nested junk into every field of a real meta.json (made by
  `nanopt tokenize` in conftest), and deletes fields: opening the dataset, and reading what train and eval read
  from it, is a DataError (one line) or works, with a finite, positive bits per byte. Hypothesis runs
  derandomized; NANOPT_FUZZ_EXAMPLES asks for more examples.
- Real files: a named pipe (FIFO) where a shard, tokenizer.json, meta.json or metrics.jsonl belongs makes
  `nanopt train` and `nanopt eval` exit 2 with one line instead of blocking forever (each runs in a process of its
  own, with a guard that fails the test rather than hang it); bytes 0 and negative bytes are refused by `eval`; a
  100 MB meta.json is refused by its size; deep nesting is one line.
- metrics.jsonl lines with a 5,000-digit number, deep nesting, Infinity as a step or a string where a number
  belongs are skipped: a resume and `eval` still work.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonhelp import field_paths

from nanopt.data.dataset import TokenDataset
from nanopt.errors import DataError, NanoptError
from nanopt.evaluate.report import bits_per_byte
from nanopt.rundir import RunDir
from nanopt.train.checkpoint.resume import data_fingerprint
from nanopt.train.observe.metrics import MetricsLog, event_marks, loss_curves, read_metrics
from nanopt.train.observe.phases import run_time

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "100"))
PROPERTY = settings(derandomize=True, database=None, deadline=timedelta(seconds=10), max_examples=EXAMPLES,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
GUARD_S = 60  # a command that blocks on a named pipe never ends: this fails the test instead; not about speed

# JSON text of values nanopt never writes where a field of meta.json belongs (some of them, in some fields, are
# valid: `created` may be any string). Written as text, since json.dumps cannot write all of them.
JUNK = ["0", "-1", "-9223372036854775809", "9223372036854775808", str(2**70), "1" * 4000, "1" * 5000, "1e400",
        "-1e400", "NaN", "Infinity", "-Infinity", "2.5", "2.0", "-0.0", "true", "false", "null", '""', '"x"',
        '"uint8"', '"object"', '"../../etc/passwd"', '"/etc/passwd"', '"train/../../x.npy"', '"train/"',
        '"val/shard-00000.npy"', '"train/shard-00000.npy\\u0000"', '"' + "a" * 100_000 + '"', "[]", "{}", "[1, 2]",
        '{"file": "train/shard-00000.npy", "tokens": 1}', "[" * 100 + "]" * 100, '{"a": ' * 70 + "1" + "}" * 70,
        "[" * 10_000 + "]" * 10_000]
DELETE = "<delete>"


def junk_values() -> st.SearchStrategy[str]:
    scalars = st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none())
    nested = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=4), inner, max_size=3), max_leaves=6)
    return st.one_of(st.sampled_from(JUNK), nested.map(json.dumps), st.just(DELETE))


def mutated(meta: dict[str, Any], path: tuple, junk: str) -> str:
    """meta.json's text with the field at `path` replaced by the JSON text `junk` (or deleted)."""
    copy = json.loads(json.dumps(meta))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if junk == DELETE:
        del parent[path[-1]]
        return json.dumps(copy)
    parent[path[-1]] = "@@JUNK@@"
    return json.dumps(copy).replace('"@@JUNK@@"', junk)


def read_like_train_and_eval(data: Path) -> None:
    """Open the dataset and read from it what train and eval read: counts, bits per byte, the fingerprint a resume
    compares, the first window of every split, the tokenizer."""
    dataset = TokenDataset.open(data)
    for split in dataset.splits:
        tokens = dataset.split_tokens(split)
        dataset.split_documents(split)
        if tokens:
            bpb = bits_per_byte(2.0, dataset.bytes_per_token(split))
            assert math.isfinite(bpb) and bpb > 0, (split, bpb)
            dataset.stream(split).windows(np.array([0]), min(tokens, 8))
    assert dataset.id_limit >= dataset.vocab_size
    data_fingerprint(dataset)
    dataset.tokenizer()


class Blocked(BaseException):
    """Not an OSError (TimeoutError is one) nor an Exception: no `except` of the code under test swallows it."""


@contextmanager
def guard(seconds: int = GUARD_S) -> Iterator[None]:
    """A read in this process that blocks (on a named pipe) fails the test instead of hanging it."""
    def expired(*_: object) -> None:
        raise Blocked(f"still blocked after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path) -> Path:
    """A copy of the tiny dataset whose meta.json the property test rewrites (and restores)."""
    return Path(shutil.copytree(tiny_dataset, tmp_path_factory.mktemp("untrusted") / "data"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """A 4-step run with a checkpoint at step 4, trained on the tiny dataset."""
    run = tiny_run(tmp_path_factory.mktemp("trained"), tiny_dataset, "run", max_steps=4, checkpoint_interval=4,
                   eval_interval=0)
    launcher.train(run)
    return run


def copy_of(tiny_dataset: Path, root: Path, name: str = "data") -> Path:
    return Path(shutil.copytree(tiny_dataset, root / name))


def edit_meta(data: Path, change) -> None:
    meta = json.loads((data / "meta.json").read_text())
    change(meta)
    (data / "meta.json").write_text(json.dumps(meta))


# -------------------------------------------------------------------------------------- meta.json: property


def test_every_field_of_meta_json_is_checked_where_it_is_read(data: Path):
    meta = json.loads((data / "meta.json").read_text())
    original = (data / "meta.json").read_bytes()
    paths = list(field_paths(meta))
    read_like_train_and_eval(data)  # the dataset as tokenize wrote it works

    @PROPERTY
    @given(path=st.sampled_from(paths), junk=junk_values())
    def opened_or_refused(path: tuple, junk: str) -> None:
        (data / "meta.json").write_text(mutated(meta, path, junk))
        try:
            read_like_train_and_eval(data)
        except NanoptError as exc:
            assert "\n" not in exc.one_line() and "meta.json" in exc.one_line(), exc.one_line()
        finally:
            (data / "meta.json").write_bytes(original)

    opened_or_refused()


# Fields train and eval read, with a value each must refuse, and a fragment of the one line that says so.
REFUSED = [
    (("splits", "test", "bytes"), "0", "split 'test': key 'bytes' is 0"),
    (("splits", "test", "bytes"), "-5", "split 'test': key 'bytes' is -5, expected an integer from 0"),
    (("splits", "test", "tokens"), "Infinity", "Infinity where a finite number belongs"),
    (("splits", "test", "tokens"), '"9000"', "split 'test': key 'tokens' is '9000'"),
    (("splits", "test", "documents"), "1e400", "past the largest number a float holds"),
    (("splits", "train", "shards", 0, "file"), "7", "split 'train' shard 0: key 'file' is 7"),
    (("splits", "train", "shards", 0, "file"), '"../../etc/passwd"', "expected 'train/NAME'"),
    (("splits", "train", "shards", 0, "file"), '"train/../../x.npy"', "expected 'train/NAME'"),
    (("splits", "train", "shards", 0, "tokens"), "2.5", "shard 0: key 'tokens' is 2.5"),
    (("splits", "train", "shards", 0, "sha256"), "[]", "shard 0: key 'sha256' is []"),
    (("splits", "train", "max_token_id"), "70000", "key 'max_token_id' is 70000, expected an integer from -1 to 65,"),
    (("vocab_size",), str(2**70), "key 'vocab_size' is 1180591620717411303424"),
    (("vocab_size",), "0", "key 'vocab_size' is 0"),
    (("eos_id",), "true", "key 'eos_id' is True"),
    (("dtype",), '"object"', "key 'dtype' is 'object'"),
    (("format_version",), "1" * 5000, "Exceeds the limit (4300 digits)"),
    (("tokenizer", "sha256"), "1", "key 'tokenizer': key 'sha256' is 1"),
    (("splits", "val"), "[" * 10_000 + "]" * 10_000, "nested more than 64 levels deep"),
    (("splits", "val"), "[" * 100 + "]" * 100, "nested more than 64 levels deep"),
    (("splits",), '{"train": {"documents": 1, "tokens": 0, "bytes": 0, "shards": []}, "..": {}}',
     "split '..': expected a plain directory name"),
]


@pytest.mark.parametrize("path, junk, fragment", REFUSED, ids=[f"{'.'.join(map(str, p))}={j[:12]}"
                                                               for p, j, _ in REFUSED])
def test_a_wrong_field_is_one_line_naming_the_file_and_the_key(data: Path, path: tuple, junk: str, fragment: str):
    meta = json.loads((data / "meta.json").read_text())
    original = (data / "meta.json").read_bytes()
    (data / "meta.json").write_text(mutated(meta, path, junk))
    try:
        with pytest.raises(DataError) as caught:
            TokenDataset.open(data)
    finally:
        (data / "meta.json").write_bytes(original)
    line = caught.value.one_line()
    assert str(data / "meta.json") in line and fragment in line and "Hint:" in line, line


def test_a_100_mb_meta_json_is_refused_by_its_size(tiny_dataset: Path, tmp_path: Path):
    data = copy_of(tiny_dataset, tmp_path)
    text = (data / "meta.json").read_text()
    with open(data / "meta.json", "w") as f:  # valid JSON: the object, then 100 MB of white space
        f.write(text)
        f.write(" " * (100 << 20))
    with pytest.raises(DataError, match=r"meta.json: 104,8\d\d,\d\d\d bytes, more than the 64 MiB"):
        TokenDataset.open(data)


# -------------------------------------------------------------------------------- meta.json: the real commands


@pytest.mark.parametrize("change, fragment", [
    (lambda m: m["splits"]["test"].update(bytes=0), "split 'test': key 'bytes' is 0"),
    (lambda m: m["splits"]["test"].update(bytes=-406210), "key 'bytes' is -406210"),
    (lambda m: m["splits"]["test"].update(tokens=float("inf")), "Infinity where a finite number belongs"),
], ids=["bytes-0", "bytes-negative", "tokens-infinity"])
def test_eval_refuses_absurd_counts_in_one_line(trained: Path, tiny_dataset: Path, tmp_path: Path, cli_in_process,
                                                change, fragment: str):
    data = copy_of(tiny_dataset, tmp_path)
    edit_meta(data, change)
    result = cli_in_process("eval", trained, "--data", data, "--tokens", "1024", "--no-samples")
    assert_user_error(result, str(data / "meta.json"), fragment)


# ------------------------------------------------------------------------------------------ named pipes (FIFO)


def make_fifo(path: Path) -> str:
    path.unlink()
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("what", ["test/shard-00000.npy", "train/shard-00001.npy", "tokenizer.json", "meta.json"])
@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_named_pipe_in_a_dataset_is_one_line_not_a_hang(command: str, what: str, trained: Path,
                                                          tiny_dataset: Path, tmp_path: Path, launcher: Launcher):
    data = copy_of(tiny_dataset, tmp_path)
    argv: list[object] = ["eval", trained, "--data", data, "--tokens", "1024", "--no-samples"]
    if command == "train":
        argv = ["train", tiny_run(tmp_path, data, "fresh"), "--no-live"]
    fifo = make_fifo(data / what)
    child = launcher.start(*argv)
    launcher.wait(child, timeout=GUARD_S)
    assert_user_error(child, fifo, "is a named pipe (FIFO)")


def test_a_named_pipe_for_metrics_jsonl_is_one_line_not_a_hang(trained: Path, tmp_path: Path,
                                                               launcher: Launcher):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    metrics = RunDir(run).metrics
    fifo = make_fifo(metrics)
    child = launcher.start("train", run, "--no-live", "--set", "max_steps=6", "--allow-changed")
    launcher.wait(child, timeout=GUARD_S)
    assert_user_error(child, fifo, "is a named pipe (FIFO)")
    with guard():
        with pytest.raises(NanoptError, match="is a named pipe"):
            read_metrics(run)


def test_tokenize_does_not_block_on_a_named_pipe_where_meta_json_belongs(tiny_dataset: Path, tmp_path: Path):
    from nanopt.data.output import is_dataset
    from nanopt.data.tokenizers.tokenizer import load_tokenizer

    data = copy_of(tiny_dataset, tmp_path)
    make_fifo(data / "meta.json")
    with guard():
        assert not is_dataset(data)  # so --force will not replace it
        assert load_tokenizer(str(data)).eos_token == "<|endoftext|>"  # its tokenizer.json still loads
        make_fifo(data / "tokenizer.json")
        with pytest.raises(DataError, match="tokenizer.json: is a named pipe"):
            load_tokenizer(str(data / "tokenizer.json"))


# ------------------------------------------------------------------------------------------------ metrics.jsonl


BAD_LINES = [
    '{"kind": "train", "step": 1, "tokens": 64, "loss": ' + "1" * 5000 + "}",
    '{"kind": "train", "step": ' + "9" * 5000 + ', "tokens": 64, "loss": 1.0}',
    '{"kind": "eval", "step": Infinity, "tokens": 64, "val_loss": 2.0}',
    '{"kind": "train", "step": "3", "tokens": 64, "loss": 1.0}',
    '{"kind": "train", "step": 2, "tokens": "many", "loss": 1.0}',
    '{"kind": "train", "step": 2, "tokens": 64, "loss": "low"}',
    '{"kind": "phases", "step": 1, "session_start": 1.0, "seconds": {"train": "x"}, "world_size": 1}',
    '{"kind": "phases", "step": 1, "session_start": 1.0, "seconds": [], "world_size": 0}',
    '{"kind": "phases", "step": 1, "session_start": NaN, "seconds": {}}',
    '{"kind": "event", "event": "recovery", "step": -1}',
    '{"kind": "train", "step": 1, "junk": ' + "[" * 5000 + "]" * 5000 + "}",
    "[1, 2, 3]",
    '"a string"',
    "x" * (2 << 20),
]


def test_unreadable_metrics_lines_are_skipped_by_every_reader(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    good = [{"kind": "train", "step": 1, "tokens": 64, "loss": 5.0, "step_time_s": 0.5},
            {"kind": "event", "event": "loss_spike", "step": 1},
            {"kind": "phases", "step": 1, "session_start": 1.0, "seconds": {"train": 1.0}, "world_size": 1}]
    lines = [json.dumps(good[0]), *BAD_LINES, json.dumps(good[1]), json.dumps(good[2])]
    RunDir(run).metrics.write_text("\n".join(lines) + "\n")
    records = read_metrics(run)
    assert records == good
    assert loss_curves(records) == (([64], [5.0]), ([], []))
    assert event_marks(records) == {"loss_spike": [64]}
    assert run_time(records).wall_seconds == 1.0
    MetricsLog(run, enabled=True).truncate_after(1)  # a resume: the unreadable lines go, the records stay
    assert [json.loads(line) for line in RunDir(run).metrics.read_text().splitlines()] == good


def test_a_resume_and_eval_read_past_unreadable_metrics_lines(trained: Path, tmp_path: Path, launcher: Launcher,
                                                              cli_in_process):
    run = Path(shutil.copytree(trained, tmp_path / "run"))
    with open(RunDir(run).metrics, "a") as f:
        f.write("\n".join(BAD_LINES[:4]) + "\n")
    evaluated = cli_in_process("eval", run, "--tokens", "1024", "--no-samples", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout)["train_seconds"] > 0  # from the records that are readable
    resumed = launcher.run("train", run, "--no-live", "--set", "max_steps=6", "--allow-changed")
    assert resumed.status == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert max(r["step"] for r in read_metrics(run) if r.get("kind") == "train") == 6
