"""A run directory and a dataset from a stranger, damaged or crafted one file at a time, through the real readers of
`nanopt train`, `nanopt eval` and `nanopt export` (docs/design.md, the trust boundary).

Every file of a real trained run (configs, metrics.jsonl, pointers, each checkpoint's meta.json, weights, optimizer
state and tokenizer) and of its real dataset (meta.json, tokenizer.json, shards) is a target; hypothesis picks one
and a mutation: flipped bytes, a truncation, a JSON value replaced by another value or type (huge, negative,
non-finite, nested, markup, a shell command), a link to a file outside, a FIFO, a directory. Each command must end
in exit 0 (the damage was harmless, or a documented fallback with its note) or exit 2 with one line and a hint;
never a traceback, never a hang, and never a byte written outside the run (the dataset, the link's target and the
files beside the run are hashed before and after).

The number of examples is small in `make test`; NANOPT_FUZZ_EXAMPLES=500 explores more (derandomized either way,
so a failure reproduces).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from faulthelp import Launcher, tiny_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("NANOPT_FUZZ_EXAMPLES", "12"))
# The 8-bit run differs from the AdamW one in its optimizer's files only, and each of its `nanopt train` cases
# compiles the 8-bit step (seconds on a CPU): at depth it gets a share of the examples, so CI's deep stage stays in
# minutes.
EXAMPLES_8BIT = min(EXAMPLES, 40)
COMMAND_TIMEOUT_S = 60  # a FIFO read without O_NONBLOCK hangs forever: the launcher kills it and the test fails

NEWEST = "step-000006"  # the pristine run's last checkpoint: 6 steps, one every 2
JSON_VALUES = [None, True, -1, 0, 2**70, 1e308, float("inf"), float("nan"), "", "x" * 10_000, "$(touch PWNED)",
               "\x1b]0;pwned\x07\x1b[2K", "[red]markup[/red]", [], {}, [[[[[[[[[[[[[]]]]]]]]]]]]], {"a": {"b": 1}},
               "../../../etc/passwd", "__HUGE__", "__DEEP__"]


# 8-bit AdamW stores each moment of the embedding as codes, scales and a code book: other files to damage. Its step
# is compiled on every `nanopt train` (seconds on a CPU), hence slow.
@pytest.fixture(scope="module", params=["adamw", pytest.param("adamw8bit", marks=pytest.mark.slow)])
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path,
             launcher: Launcher) -> Path:
    """A trained tiny run (checkpoints, pointers, metrics, loss chart) and a copy of its dataset, side by side."""
    if request.param == "adamw8bit":
        pytest.importorskip("torchao")
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(tiny_dataset, root / "data")
    # data "../data": relative to the run, so a copy of the two side by side reads its own dataset.
    run = tiny_run(root, root / "data", "run", max_steps=6, checkpoint_interval=2, eval_interval=3, data="../data",
                   optimizer=request.param)
    launcher.train(run)
    assert (run / "checkpoints" / "latest").read_text().strip() == NEWEST
    return root


def targets(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                  and p.suffix != ".png")


def _mutate_json(data: object, path: list[int], value: object) -> object:
    """Replace the value found by walking `path` (indices into keys / items, modulo their count) with `value`."""
    if not path or not isinstance(data, (dict, list)) or not data:
        return value
    if isinstance(data, dict):
        key = sorted(data)[path[0] % len(data)]
        return {**data, key: _mutate_json(data[key], path[1:], value)}
    index = path[0] % len(data)
    return [*data[:index], _mutate_json(data[index], path[1:], value), *data[index + 1:]]


def _dumps(data: object) -> str:
    """JSON text, with two values json.dumps cannot write: a 5,000-digit number (past Python's int-string limit)
    and a list nested 100,000 deep (past the recursion limit)."""
    text = json.dumps(data, allow_nan=True)
    return text.replace('"__HUGE__"', "1" * 5000).replace('"__DEEP__"', "[" * 100_000 + "]" * 100_000)


@st.composite
def damage(draw: st.DrawFn, names: list[str]) -> tuple[str, str, object]:
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from(["flip", "truncate", "json", "json", "link", "fifo", "directory"]))
    if kind == "flip":
        return name, kind, draw(st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1, max_size=8))
    if kind == "truncate":
        return name, kind, draw(st.floats(0, 1, exclude_max=True))
    if kind == "json":
        value = draw(st.sampled_from(JSON_VALUES))
        return name, kind, (draw(st.lists(st.integers(0, 50), max_size=4)), value)
    return name, kind, None


def apply(root: Path, name: str, kind: str, arg: object, victim: Path) -> None:
    path = root / name
    if kind == "flip":
        data = bytearray(path.read_bytes())
        for where, xor in arg:
            if data:
                data[min(int(where * len(data)), len(data) - 1)] ^= xor
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:int(arg * path.stat().st_size)])
    elif kind == "json" and path.suffix == ".jsonl":  # one record of metrics.jsonl
        where, value = arg
        lines = path.read_text(encoding="utf-8").splitlines()
        index = where[0] % len(lines) if where and lines else 0
        record = json.loads(lines[index]) if lines else None
        lines[index:index + 1] = [_dumps(_mutate_json(record, where[1:], value))]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif kind == "json":
        where, value = arg
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError):  # not JSON (weights, shards, metrics.jsonl): the value replaces it
            data = None
        path.write_text(_dumps(_mutate_json(data, where, value)), encoding="utf-8")
    else:
        path.unlink()
        if kind == "link":
            path.symlink_to(victim)
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()


def check(child, what: str, newest: str) -> None:
    """Exit 0 names the newest checkpoint: it was used (eval's table, export's source, train's "resumed from"),
    or a note says why it was not; a silent fallback to an older one would ship or score the wrong model."""
    err = child.stderr
    assert child.status in (0, 2), f"{what}: exit {child.status}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{what}:\n{err[-3000:]}"
    if child.status == 0:
        assert newest in child.stdout + err, f"{what}: {newest} neither used nor said to be skipped\n{err[-3000:]}"
    if child.status == 2:
        said = [line for line in err.splitlines() if "Hint:" in line]
        assert len(said) == 1, f"{what}: not one line with a hint:\n{err[-3000:]}"
        assert "\x1b]" not in said[0] and "\x07" not in said[0], f"{what}: a control sequence reached the terminal"


COMMANDS = {
    "eval": lambda run, out: ("eval", run, "--max-new-tokens", "4", "--prompt", "The", "--tokens", "2k"),
    "export": lambda run, out: ("export", run, "--out", out),
    "train": lambda run, out: ("train", run, "--no-live", "--set", "max_steps=8", "--allow-changed"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_damaged_or_crafted_file_is_one_line_or_a_noted_fallback(command: str, pristine: Path,
                                                                    launcher: Launcher):
    names = targets(pristine)
    assert any(n.startswith("run/checkpoints/") for n in names) and any(n.startswith("data/") for n in names)

    eight_bit = json.loads((pristine / "run" / "train.json").read_text()).get("optimizer") == "adamw8bit"

    @settings(max_examples=EXAMPLES_8BIT if eight_bit else EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(damage(names))
    def one(case: tuple[str, str, object]) -> None:
        sandbox = Path(tempfile.mkdtemp(prefix="fuzz-"))
        try:
            root = sandbox / "shared"
            shutil.copytree(pristine, root, symlinks=True)
            victim = sandbox / "victim.txt"
            victim.write_text("a file of the user's, outside the run\n")
            apply(root, *case, victim)
            outside = {"victim": victim.read_bytes(), "data": _digest(root / "data"),
                       "beside": sorted(p.name for p in sandbox.iterdir())}
            child = launcher.start(*COMMANDS[command](root / "run", sandbox / "export"))
            launcher.wait(child, timeout=COMMAND_TIMEOUT_S)
            check(child, f"{command} with {case[0]} damaged by {case[1]} {str(case[2])[:80]}", NEWEST)
            assert victim.read_bytes() == outside["victim"], f"{case}: wrote through a link"
            assert _digest(root / "data") == outside["data"], f"{case}: the dataset changed"
            beside = sorted(p.name for p in sandbox.iterdir() if p.name != "export")
            assert beside == [n for n in outside["beside"] if n != "export"], f"{case}: wrote beside the run"
            assert not Path("PWNED").exists()
        finally:
            shutil.rmtree(sandbox, ignore_errors=True)

    one()


def _digest(path: Path) -> dict[str, str]:
    """Every entry under `path`: a file's sha256, anything else its type (never opened: a planted FIFO would block
    the test itself)."""
    found = {}
    for p in sorted(path.rglob("*")):
        mode = p.lstat().st_mode
        if stat.S_ISREG(mode):
            found[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif not stat.S_ISDIR(mode):
            found[str(p.relative_to(path))] = f"mode {stat.S_IFMT(mode):o}"
    return found

