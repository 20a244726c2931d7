"""The process guard of ``tests/conftest.py``: a fast-tier module that does not declare
``pytest.mark.starts_processes`` (this one) cannot start a process, by any of the ways
the suite starts them."""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from tests import forkserver

REFUSED = r"test_tiers\.py::.* starts a process \({}\) but its module declares neither"


def test_an_undeclared_subprocess_fails_the_test_before_it_starts():
    with pytest.raises(RuntimeError, match=REFUSED.format(r"subprocess\.Popen")):
        subprocess.run(["true"], check=True)


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_an_undeclared_multiprocessing_start_fails_the_test(start):
    ctx = forkserver.context() if start == "forkserver" else multiprocessing.get_context(start)
    with pytest.raises(RuntimeError, match=REFUSED.format("multiprocessing")):
        ctx.Process(target=print).start()
