"""The documentation holds together: every relative link in README.md, SECURITY.md and docs/ leads to a file of the
repository and, for `#anchor`, to a heading of that page; every page of docs/ is in its index; and the run directory
page names every path nanopt/rundir.py knows. (tests/test_examples.py runs the pages' command lines.)"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from clihelp import REPO

from nanopt import rundir

PAGES = [REPO / "README.md", REPO / "SECURITY.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")


def prose(text: str) -> str:
    """The text a reader sees links in: without fenced code blocks, inline code and HTML comments."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "code", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links reduced to their text) lowercased, punctuation dropped,
    spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # GitHub numbers repeated headings: name, name-1, name-2
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # https:, mailto: ... are not the repository's


def test_the_pages_are_there():
    names = {page.relative_to(REPO).as_posix() for page in PAGES}
    assert {"README.md", "SECURITY.md", "docs/README.md", "docs/config.md", "docs/design.md"} <= names
    assert len(list((REPO / "docs" / "tutorials").glob("*.md"))) >= 3


@pytest.mark.parametrize("page", PAGES, ids=[page.relative_to(REPO).as_posix() for page in PAGES])
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if REPO.resolve() not in dest.parents and dest != REPO.resolve():
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO.resolve())}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_slugs_are_githubs():
    assert slug("Plan from a compute budget (`--flops`)") == "plan-from-a-compute-budget---flops"
    assert slug("Imported models and downstream scores are their references' own") == \
        "imported-models-and-downstream-scores-are-their-references-own"
    assert slug("eval_history.jsonl") == "eval_historyjsonl"
    assert slug("`warmup_steps`, `decay_fraction`") == "warmup_steps-decay_fraction"


def test_every_page_of_docs_is_in_its_index():
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in links(index)}
    missing = [page.relative_to(REPO).as_posix() for page in PAGES
               if page.parent.is_relative_to(REPO / "docs") and page != index and page.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {missing}"
    assert "docs/README.md" in {t.partition("#")[0] for t in links(REPO / "README.md")}


def test_the_run_directory_page_names_every_path_rundir_knows():
    page = (REPO / "docs" / "run-directory.md").read_text(encoding="utf-8")
    tree = re.search(r"^```\nruns/NAME/\n(.*?)^```", page, flags=re.S | re.M).group(1)
    names = [value for key, value in vars(rundir).items()
             if isinstance(value, str) and re.fullmatch(r"[A-Z_]+(_FILE|_DIR|_LOG)|CHECKPOINTS", key)]
    names += list(rundir.POINTERS)
    assert len(names) > 20
    missing = [name for name in names if not re.search(rf"(^|\s){re.escape(name)}[/ \n]", tree, flags=re.M)]
    assert not missing, f"docs/run-directory.md's tree lacks {missing} (nanopt/rundir.py has them)"


def test_the_readmes_demo_is_what_make_demo_runs():
    """The CPU demo the README shows is `make demo`'s three commands, and CI runs them in short (make demo-smoke)."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    recipe = re.search(r"^demo: .*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    made = re.findall(r"\$\(NANOPT\) ([^;\n]+)", recipe)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^## The CPU demo\n.*?^```bash\n(.*?)^```", readme, flags=re.S | re.M).group(1)
    shown = [line.split("#")[0].strip().removeprefix("nanopt ") for line in block.splitlines()]
    assert shown == [command.strip() for command in made] == ["tokenize --out data/stdlib", "train runs/demo",
                                                              "eval runs/demo"]
    smoke = re.search(r"^demo-smoke: .*\n((?:\t.*\n)+)", makefile, flags=re.M).group(1)
    assert [re.match(r"\w+", c).group() for c in re.findall(r"\$\(NANOPT\) ([^;\n]+)", smoke)] == \
        ["tokenize", "train", "eval"]
    assert "make demo-smoke" in (REPO / ".ci" / "run").read_text(encoding="utf-8")


def test_the_design_pages_layers_are_the_import_contracts():
    """docs/design.md's table of layers names the layers of .importlinter's contract, in its order (make lint
    enforces the contract; this keeps the page that explains it in step)."""
    contract = (REPO / ".importlinter").read_text(encoding="utf-8")
    lines = re.search(r"^layers =\n((?:[ \t]+.*\n)+)", contract, flags=re.M).group(1).splitlines()
    layers = [sorted(part.strip() for part in line.split("|")) for line in lines]
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    table = re.search(r"^## The layers\n.*?\n(\| layer .*?)\n\n", design, flags=re.S | re.M).group(1)
    rows = [sorted(re.findall(r"`(nanopt\.\w+)`", row.split("|")[2])) for row in table.splitlines()[2:]]
    assert rows == layers
