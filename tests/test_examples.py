"""Every example a user may copy runs: the `nanopt ...` lines in each command's --help epilog and in the code blocks
of README.md, SECURITY.md and every page of docs/.

Each example is parsed by the command's own parser (its options exist, its values convert), without running it;
every path it names under runs/ or data/ is in the repository or made by an earlier example of the same block
(`tokenize --out`, `export`, the checkpoints `train` keeps); a checkpoint it names is one that `train` keeps; the
run configs it names load with its --set overrides and, for `train`, its batch divides over its ranks. The
`estimate` examples are cheap, so they are run.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest
import typer.main
from clihelp import REPO

from nanopt.cli import app
from nanopt.config import load_run
from nanopt.parsing import parse_overrides
from nanopt.rundir import RunDir, step_dir_name

CHECKPOINT_WORDS = {"latest", "best", "auto", "none"}  # --checkpoint / --resume values that name no directory


@dataclass(frozen=True)
class Example:
    block: str  # where it is written: "nanopt train --help" or "README.md line 42"
    index: int  # its place in the block: outputs of earlier examples exist for later ones
    line: str

    @property
    def id(self) -> str:
        return f"{self.block}: {self.line}"


def example_lines(text: str) -> list[str]:
    """The command lines of a block: continuation lines joined, only those that run nanopt."""
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    return [line.strip() for line in lines if re.match(r"\s*(nanopt |torchrun .* -m nanopt )", line)]


COPY = re.compile(r"^\s*mkdir (runs/\S+) && cp (runs/\S+)/model\.json \2/train\.json \1/", re.M)


def documents() -> list[Path]:
    """The pages a user reads examples in: the README, SECURITY.md and every page of docs/ (relative to the repo)."""
    pages = [REPO / "README.md", REPO / "SECURITY.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [page.relative_to(REPO) for page in pages if page.is_file()]


def documents_text() -> str:
    return "\n".join((REPO / page).read_text(encoding="utf-8") for page in documents())


def copy_lines() -> list[str]:
    return [line.split("#")[0].strip() for line in documents_text().splitlines() if COPY.match(line)]


def copied_runs() -> dict[Path, Path]:
    """Run directories a page's block makes by copying a shipped run's settings (`mkdir runs/mine && cp
    runs/demo/model.json runs/demo/train.json runs/mine/`): the copy, and the run it copies, for its later examples."""
    return {Path(target): Path(source) for target, source in COPY.findall(documents_text())}


def test_the_readme_copies_a_runs_settings_and_never_its_checkpoints(tmp_path: Path):
    """After `make demo` runs/demo holds checkpoints: a copy that took them would be refused as a new run."""
    demo = tmp_path / "runs" / "demo"
    (demo / "checkpoints" / "step-000010").mkdir(parents=True)
    for name in ("model.json", "train.json", "metrics.jsonl", "eval_history.jsonl"):
        (demo / name).write_text("{}")
    lines = copy_lines()
    assert len(lines) >= 2 and not re.search(r"^\s*cp -r runs/", documents_text(), re.M)
    for line in lines:
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True)
    for target in copied_runs():
        assert sorted(p.name for p in (tmp_path / target).iterdir()) == ["model.json", "train.json"], target


def cli_group() -> click.Group:
    return typer.main.get_command(app)


def epilog_examples() -> list[Example]:
    return [Example(f"nanopt {name} --help", i, line) for name, command in cli_group().commands.items()
            for i, line in enumerate(example_lines(command.epilog or ""))]


def page_examples() -> list[Example]:
    """The examples of every page's code blocks; each block is one sequence (its outputs exist for its later lines)."""
    found = []
    for page in documents():
        text = (REPO / page).read_text(encoding="utf-8")
        for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
            where = f"{page} line {text.count(chr(10), 0, block.start()) + 1}"
            found += [Example(where, i, line) for i, line in enumerate(example_lines(block.group(1)))]
    return found


EXAMPLES = epilog_examples() + page_examples()


def nanopt_argv(line: str) -> tuple[list[str], int]:
    """The arguments after `nanopt` (or `torchrun ... -m nanopt`), and the ranks torchrun itself would start."""
    words = shlex.split(line, comments=True)
    if words[0] == "torchrun":
        start = words.index("-m") + 2
        ranks = int(words[words.index("--nproc_per_node") + 1]) if "--nproc_per_node" in words else 1
        return words[start:], ranks
    return words[1:], 1


def parse(example: Example) -> tuple[str, dict, list[str], int]:
    """(command, parsed parameters, raw arguments, torchrun ranks); a click error if the example does not parse."""
    argv, ranks = nanopt_argv(example.line)
    command = cli_group().commands[argv[0]]
    with command.make_context(argv[0], argv[1:]) as ctx:
        return argv[0], dict(ctx.params), argv[1:], ranks


@cache  # one `git ls-files` for the session, not one per example
def shipped() -> frozenset[Path]:
    """Every file the repository tracks, and every directory above one."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell shipped paths from local ones")
    paths = {Path(f) for f in files.splitlines()}
    return frozenset(paths | {parent for path in paths for parent in path.parents})


def kept_checkpoints(run_dir: Path, sets: list[str]) -> set[Path]:
    """The checkpoint directories a finished `nanopt train RUN` leaves: the newest keep_checkpoints of those saved
    every checkpoint_interval steps and at the last step."""
    run = load_run(REPO / run_dir, parse_overrides(sets))
    interval, total = run.train.checkpoint_interval, run.total_steps
    saved = sorted({*range(interval, total + 1, interval), total} if interval else {total})
    return {RunDir(run_dir).checkpoints / step_dir_name(step) for step in saved[-max(1, run.train.keep_checkpoints):]}


def outputs(command: str, params: dict) -> set[Path]:
    """The paths an example creates, which later examples of its block may name."""
    if command == "tokenize":
        return {params["out"]}
    if command == "export":
        return {params["out"] or RunDir(params["run_dir"]).export_dir}
    if command == "import":
        return {params["run"]}
    if command == "plan":  # a new run directory
        return {params["out"]}
    if command == "estimate" and params.get("write_model"):
        return {params["write_model"]}
    if command == "train" and (REPO / params["run_dir"] / "train.json").is_file():
        return kept_checkpoints(params["run_dir"], params["sets"] or [])
    return set()


def named_paths(command: str, params: dict, argv: list[str]) -> set[Path]:
    """Paths under runs/ or data/ the example names, checkpoint names resolved inside their run."""
    paths = {Path(word) for word in argv if word.startswith(("runs/", "data/"))}
    runs = params.get("run_dirs") or ([params["run_dir"]] if params.get("run_dir") else [])
    checkpoint = params.get("checkpoint") or params.get("resume")
    if checkpoint and checkpoint not in CHECKPOINT_WORDS and "/" not in checkpoint:
        paths |= {RunDir(run).checkpoints / checkpoint for run in runs}
    return paths - outputs(command, params)  # an example's own --out need not exist before it


def available_before(example: Example) -> set[Path]:
    made: set[Path] = set()
    for earlier in EXAMPLES:
        if earlier.block == example.block and earlier.index < example.index:
            made |= made_by(earlier)
    return made


@cache  # a block's later examples ask again for what its earlier ones make
def made_by(example: Example) -> frozenset[Path]:
    command, params, _, _ = parse(example)
    return frozenset(outputs(command, params))


def is_available(path: Path, repository: frozenset[Path], made: set[Path]) -> bool:
    made = made | set(copied_runs())
    return path in repository or any(path == out or out in path.parents for out in made)


# ---------------------------------------------------------------------------------------------------- tests


def test_every_command_has_examples_and_so_do_the_pages():
    blocks = {e.block for e in EXAMPLES}
    assert {f"nanopt {name} --help" for name in cli_group().commands} <= blocks
    assert sum(e.block.startswith("README.md") for e in EXAMPLES) >= 8  # the demo and the GPU quickstart
    assert sum(e.block.startswith("docs") for e in EXAMPLES) >= 80
    tutorials = {Path(e.block.split(" line ")[0]) for e in EXAMPLES if e.block.startswith("docs/tutorials/")}
    assert len(tutorials) >= 3, tutorials


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_an_example_parses(example: Example):
    try:
        parse(example)
    except click.ClickException as exc:
        pytest.fail(f"{example.block}: `{example.line}` does not parse: {exc.format_message()}")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_the_paths_an_example_names_exist(example: Example):
    command, params, argv, _ = parse(example)
    repository, made = shipped(), available_before(example)
    missing = sorted(str(p) for p in named_paths(command, params, argv) if not is_available(p, repository, made))
    assert not missing, (f"{example.block}: `{example.line}` names {', '.join(missing)}, which is not in the "
                         "repository and not made by an earlier example of the block")


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_the_runs_an_example_names_load_with_its_settings(example: Example):
    command, params, _, ranks = parse(example)
    runs = params.get("run_dirs") or ([params["run_dir"]] if params.get("run_dir") else [])
    for run_dir in runs:
        if (REPO / run_dir / "train.json").is_file():
            run = load_run(REPO / run_dir, parse_overrides(params.get("sets") or []))
            if command == "train":  # what `nanopt train` checks before it starts any process
                run.grad_accum_steps(ranks * params["nproc_per_node"] * params["nnodes"])


ESTIMATES = [e for e in EXAMPLES if nanopt_argv(e.line)[0][0] == "estimate"]


@pytest.mark.parametrize("example", ESTIMATES, ids=[e.id for e in ESTIMATES])
def test_an_estimate_example_runs(example: Example, cli_in_process, monkeypatch: pytest.MonkeyPatch,
                                  tmp_path: Path):
    monkeypatch.chdir(REPO)
    argv = nanopt_argv(example.line)[0]
    for copy, source in copied_runs().items():
        if str(copy) in argv:  # the README's copy of a shipped run: estimate it in a directory of its own
            shutil.copytree(REPO / source, tmp_path / copy)
            monkeypatch.chdir(tmp_path)
    if "--write-model" in argv:  # writes a new run's model.json: elsewhere than the repository, and anew each time
        monkeypatch.chdir(tmp_path)
    result = cli_in_process(*argv)
    assert result.returncode == 0, f"{example.block}: `{example.line}`: {result.stderr}"
