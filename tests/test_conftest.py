"""The suite's own plumbing: how ``make test``'s parallel run splits and orders the tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import FIRST, REPO, SHARED_SETUP, work_unit

pytestmark = pytest.mark.slow


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
#: Those of :data:`COLLECTED` that declare the slow tier in their ``pytestmark``.
SLOW = {"test_packaging.py", "test_conftest.py", FIRST}


def collected_modules(*args: str) -> list[str]:
    """The modules of :data:`COLLECTED` that ``pytest --collect-only ARGS`` collects, in its
    order, one entry per test."""
    paths = [f"tests/{m}" for m in COLLECTED]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *args, *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode in (0, 5), proc.stderr[-2000:]  # 5: every test deselected
    lines = proc.stdout.splitlines()
    return [line.split("::", 1)[0].removeprefix("tests/") for line in lines if "::" in line]


def test_the_slow_tier_is_collected_first_with_the_walkthrough_at_its_head():
    modules = collected_modules()
    order = list(dict.fromkeys(modules))
    assert sorted(order) == sorted(COLLECTED)
    assert order[0] == FIRST
    declared = set(collected_modules("-m", "slow"))
    assert declared == SLOW  # the tier each module declares, and only those
    # (``-m "not slow"``, ``make test-fast``, selects the complement: pytest's own rule)
    slow = [m in declared for m in order]
    assert slow == sorted(slow, reverse=True)  # every slow module before every fast one
    assert len(order) == len(set(modules))  # each module's tests stay together


def test_each_test_process_runs_torch_on_one_thread():
    import torch

    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == 1
