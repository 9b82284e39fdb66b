"""Installing nanopt: its metadata builds without a warning from setuptools (`pip install` printed
"project.license as a TOML table is deprecated" three times, which reads as a broken package), and says the license
as an SPDX expression."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clihelp import REPO


def test_the_package_metadata_builds_without_a_setuptools_warning(tmp_path: Path):
    pytest.importorskip("setuptools")
    source = tmp_path / "source"  # a copy: building writes nanopt.egg-info beside pyproject.toml
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "nanopt", source / "nanopt", ignore=shutil.ignore_patterns("__pycache__"))
    build = ("from setuptools import build_meta; "
             f"print(build_meta.prepare_metadata_for_build_wheel({str(tmp_path / 'meta')!r}))")
    (tmp_path / "meta").mkdir()
    result = subprocess.run([sys.executable, "-W", "always", "-c", build], cwd=source, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Deprecat" not in result.stderr and "deprecated" not in result.stderr, result.stderr[-3000:]
    metadata = (tmp_path / "meta" / result.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata
