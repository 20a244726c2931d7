"""``veoptim-serve`` without the ``service`` extra: one line naming the install command.

The extra's packages are made unimportable in a new interpreter by a ``sitecustomize``
on ``PYTHONPATH`` (nothing is uninstalled); the command then stops before any model loads
with one error line and exit status 2, instead of a traceback through Hydra.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.serve import SERVICE_MODULES
from tests.conftest import REPO

pytestmark = pytest.mark.slow

BLOCKER = """
import sys

BLOCKED = {blocked!r}


class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Blocked())
"""


def test_serve_without_the_service_extra_names_the_pip_install(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(SERVICE_MODULES)))
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{REPO}", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.serve", f"run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1, lines
    assert "ERROR veoptim: ConfigError: veoptim-serve needs the service extra" in lines[0]
    assert "No module named 'fastapi'" in lines[0]
    assert lines[0].endswith("install it with pip install 'veoptim[service]'.")
