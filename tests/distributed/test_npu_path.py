"""The Ascend npu path without Ascend: a fake torch_npu, in interpreters of their own.

Two kinds of check, each in fresh interpreters because a torch_npu (even a fake one)
renames torch's PrivateUse1 backend for the rest of the process:

* the suites that drive the npu path (device, process group, RNG state, offload
  staging) against a recording fake ``torch.npu`` (``npu_fake_suite.py``,
  ``tests/optim/npu_offload_suite.py``), run as one pytest session;
* torch's backend autoload (``TORCH_DEVICE_BACKEND_AUTOLOAD``) with a fake
  ``torch-npu`` distribution that declares the ``torch.backends`` entry point the
  real wheel declares: what docs/ascend.md says about it is checked here against
  the pinned torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.fake_npu import FAKE_NPU_ENV

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SUITES = ("tests/distributed/npu_fake_suite.py", "tests/optim/npu_offload_suite.py")
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != AUTOLOAD}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_npu_path_suites_pass_against_the_fake_torch_npu():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITES],
        cwd=REPO,
        env=_env(**{FAKE_NPU_ENV: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert re.match(r"\d+ passed", summary), summary
    assert not re.search(r"skipped|deselected|xfail|xpass|error", summary), summary


# A torch-npu distribution as pip installs it, minus CANN: the entry point that makes
# `import torch` import torch_npu, and a package that registers torch.npu (or fails
# the way a host without CANN makes the real one fail).
ENTRY_POINTS = "[torch.backends]\ntorch_npu = torch_npu:_autoload\n"
PACKAGE = """\
import os
if os.environ.get("FAKE_TORCH_NPU_BROKEN") == "1":
    raise ImportError("libascendcl.so: cannot open shared object file")
from tests.distributed.fake_npu import register_fake_npu
register_fake_npu()
def _autoload():
    pass
"""
PROBE = """\
import json, sys
import torch
autoloaded = "torch_npu" in sys.modules
loaded = sys.modules.get("torch_npu")
from veoptim.distributed import init_distributed, resolve_device
from veoptim.errors import DistributedError
init_distributed("cpu", "auto", {})
after_cpu_run = "torch_npu" in sys.modules
try:
    device, error = str(resolve_device("npu")), ""
except DistributedError as exc:
    device, error = "", str(exc)
reimported = loaded is not None and sys.modules["torch_npu"] is not loaded
print(json.dumps(dict(autoloaded=autoloaded, after_cpu_run=after_cpu_run, device=device,
                      error=error, reimported=reimported)))
"""
CASES = {  # name -> (package broken, TORCH_DEVICE_BACKEND_AUTOLOAD)
    "installed": (False, None),
    "installed_autoload_off": (False, "0"),
    "no_cann": (True, None),
    "no_cann_autoload_off": (True, "0"),
}


@pytest.fixture(scope="module")
def autoload(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Run PROBE once per case, all at once (interpreter start dominates)."""
    site = tmp_path_factory.mktemp("site")
    (site / "torch_npu").mkdir()
    (site / "torch_npu" / "__init__.py").write_text(PACKAGE)
    dist_info = site / "torch_npu-2.13.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.13.0\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    procs = {}
    for name, (broken, autoload_flag) in CASES.items():
        extra = {"PYTHONPATH": f"{site}{os.pathsep}{REPO}", FAKE_NPU_ENV: "1"}
        extra["FAKE_TORCH_NPU_BROKEN"] = "1" if broken else "0"
        if autoload_flag is not None:
            extra[AUTOLOAD] = autoload_flag
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", PROBE],
            cwd=site,
            env=_env(**extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def _probe(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_installed_torch_npu_is_autoloaded_and_veoptims_import_is_a_no_op(autoload):
    found = _probe(autoload["installed"])
    assert found["autoloaded"] and found["device"] == "npu" and not found["error"]
    assert not found["reimported"]


def test_with_autoload_off_only_run_device_npu_imports_torch_npu(autoload):
    found = _probe(autoload["installed_autoload_off"])
    assert not found["autoloaded"] and not found["after_cpu_run"]
    assert found["device"] == "npu" and not found["error"]


def test_without_cann_import_torch_fails_unless_autoload_is_off(autoload):
    failed = autoload["no_cann"]
    assert failed.returncode != 0
    assert "Failed to load the backend extension: torch_npu" in failed.stderr
    assert f"{AUTOLOAD}=0" in failed.stderr


def test_without_cann_and_autoload_off_cpu_runs_and_npu_is_a_clear_error(autoload):
    found = _probe(autoload["no_cann_autoload_off"])
    assert not found["autoloaded"] and not found["after_cpu_run"] and not found["device"]
    assert found["error"].startswith("run.device=npu needs the optional package torch_npu")
    assert "libascendcl.so" in found["error"]
