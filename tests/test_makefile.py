"""`make install` on a machine with an NVIDIA GPU, shown on the CPU with a stand-in nvidia-smi: torch comes from the
package index whatever pip's configuration adds (a wheelhouse of CPU builds in find-links won), a .venv with a CPU
build gets the CUDA build, and a torch that cannot use the GPU stops the install, naming the driver."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from clihelp import REPO

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="needs make")
DRIVER = "550.54.15"


def host(tmp_path: Path, gpu: bool) -> dict[str, str]:
    """The environment of a machine with (or without) an NVIDIA GPU: nvidia-smi on PATH answers as one does."""
    bin_dir = tmp_path / ("gpu-bin" if gpu else "cpu-bin")
    bin_dir.mkdir(exist_ok=True)
    answers = (f'-L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)";;\n'
               f'  --query-gpu=driver_version) echo "{DRIVER}";;') if gpu else "*) exit 9;;"
    script = bin_dir / "nvidia-smi"
    script.write_text(f'#!/bin/sh\ncase "$1" in\n  {answers}\nesac\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def make(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([MAKE, "--no-print-directory", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_on_a_gpu_host_install_takes_torch_from_the_index_alone_and_checks_it(tmp_path: Path):
    venv = tmp_path / "venv"
    gpu = make("-n", "install", f"VENV={venv}", env=host(tmp_path, gpu=True)).stdout
    assert f'PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= {venv}/bin/python -m pip install -q "torch==' in gpu
    assert "sys.exit(torch.version.cuda is not None)" in gpu and "pip uninstall -q -y torch" in gpu  # a CPU build
    assert "check-gpu-torch" in gpu and f"touch {venv}/.installed-cuda" in gpu
    cpu = make("-n", "install", f"VENV={venv}", env=host(tmp_path, gpu=False)).stdout
    assert f"touch {venv}/.installed-cpu" in cpu  # another stamp: a .venv made here is looked at again with a GPU


def _wheel(folder: Path, version: str) -> None:
    """A wheel pip can resolve (name, version, metadata), of no use beyond that."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


def _resolved(env: dict[str, str]) -> str:
    """The torch version pip would install for the Makefile's requirement (a dry run, no network)."""
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                             "--quiet", "--report", "-", "torch==2.13.*"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)["install"][0]["metadata"]["version"]


def test_pip_in_the_makefiles_environment_takes_no_cpu_build_from_a_configured_wheelhouse(tmp_path: Path):
    # A development machine's pip: its configuration names a wheelhouse holding torch 2.13.0+cpu; the index (a
    # local one stands in for PyPI) holds the CUDA build 2.13.0.
    _wheel(tmp_path / "wheelhouse", "2.13.0+cpu")
    _wheel(tmp_path / "index" / "files", "2.13.0")
    (tmp_path / "index" / "torch").mkdir()
    (tmp_path / "index" / "torch" / "index.html").write_text(
        '<a href="../files/torch-2.13.0-py3-none-any.whl">torch-2.13.0-py3-none-any.whl</a>')
    (tmp_path / "pip.conf").write_text(f"[global]\nfind-links = {tmp_path / 'wheelhouse'}\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), PIP_INDEX_URL=(tmp_path / "index").as_uri(),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert _resolved(env) == "2.13.0+cpu"  # what plain `pip install "torch==2.13.*"` took on such a machine

    printed = make("-s", "--eval", "print-pip-pypi: ; @echo $(PIP_PYPI)", "print-pip-pypi", env=os.environ)
    assignments = dict(word.split("=", 1) for word in shlex.split(printed.stdout))
    assert set(assignments) == {"PIP_CONFIG_FILE", "PIP_FIND_LINKS"}, printed.stdout
    assert _resolved({**env, **assignments}) == "2.13.0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch can use the GPU: the check passes here")
def test_a_torch_that_cannot_use_the_gpu_stops_the_install_naming_the_driver(tmp_path: Path):
    failed = make("check-gpu-torch", f"PY={sys.executable}", env=host(tmp_path, gpu=True))
    assert failed.returncode != 0
    assert f"driver {DRIVER}" in failed.stderr and "(a CPU build) cannot use it" in failed.stderr
    assert "Hint:" in failed.stderr and "make install" in failed.stderr
    assert make("check-gpu-torch", f"PY={sys.executable}", env=host(tmp_path, gpu=False)).returncode == 0
