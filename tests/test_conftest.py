"""The suite's own plumbing: how ``make test``'s parallel run splits and orders the tests."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import FIRST, REPO, SHARED_SETUP, SLOW_MODULES, work_unit


def test_a_module_is_one_unit_and_modules_sharing_a_setup_are_one():
    one = "tests/checkpoint/test_versions.py"
    assert work_unit(f"{one}::test_a") == work_unit(f"{one}::test_b[x-y]") == one
    assert work_unit("tests/data/test_packing.py::test_a") != one
    shared = sorted(SHARED_SETUP)
    assert len({work_unit(f"tests/{m}::t") for m in shared}) < len(shared)
    reshard, equivalence = "checkpoint/test_reshard.py", "checkpoint/test_resume_equivalence.py"
    assert work_unit(f"tests/{reshard}::t[dense_4to2]") == work_unit(f"tests/{equivalence}::t")


#: Given fast first and the walkthrough last, so that the order collected is the conftest's.
COLLECTED = ("test_import_rules.py", "test_packaging.py", "test_conftest.py", FIRST)


def test_the_slow_tier_is_collected_first_with_the_walkthrough_at_its_head():
    paths = [f"tests/{m}" for m in COLLECTED]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = [line.split("::", 1)[0] for line in proc.stdout.splitlines() if "::" in line]
    order = list(dict.fromkeys(m.removeprefix("tests/") for m in modules))
    assert sorted(order) == sorted(COLLECTED)
    assert order[0] == FIRST
    slow = [m in SLOW_MODULES for m in order]
    assert slow == sorted(slow, reverse=True)  # every slow module before every fast one
    assert len(order) == len(set(modules))  # each module's tests stay together


def test_each_test_process_runs_torch_on_one_thread():
    import torch

    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == 1
