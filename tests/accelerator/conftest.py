"""``VEOPTIM_REQUIRE_CUDA=1``: every skipped test under tests/accelerator fails instead.

On a GPU machine a CUDA test that skips (no device visible, a driver problem, a
CPU-only torch) would otherwise let the check pass silently; with the variable
set (``scripts/accelerator_check.sh`` sets it) a skip is reported as a failure
naming its reason.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_CUDA = "VEOPTIM_REQUIRE_CUDA"
HERE = Path(__file__).resolve().parent


def cuda_required() -> bool:
    return os.environ.get(REQUIRE_CUDA, "") not in ("", "0")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.skipped and cuda_required() and HERE in Path(item.path).resolve().parents:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            f"{REQUIRE_CUDA}=1 is set, so this CUDA test must run, but it was skipped: {reason}"
        )
