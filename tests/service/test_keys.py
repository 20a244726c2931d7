"""``veoptim-serve keys add NAME`` / ``keys list`` (overrides before or after the command):
the key printed once works against a server on that run dir; refusals are one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tinker

from tasks.serve import keys_argv
from tests.conftest import REPO
from tests.service.helpers import InProcessServer

pytestmark = pytest.mark.slow


def keys(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tasks.serve", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_keys_argv_finds_the_command_among_overrides():
    assert keys_argv(["keys", "add", "a", "run.dir=x"]) == ["add", "a", "run.dir=x"]
    assert keys_argv(["run.dir=x", "keys", "add", "a"]) == ["add", "a", "run.dir=x"]
    assert keys_argv(["run.dir=x", "serve.port=9"]) is None
    assert keys_argv(["--help"]) is None


def test_a_key_added_by_the_command_opens_the_server(tmp_path):
    run_dir = tmp_path / "run"
    after = keys("keys", "add", "carol", f"run.dir={run_dir}")
    before = keys(f"run.dir={run_dir}", "keys", "add", "dave")
    assert after.returncode == 0 and before.returncode == 0, after.stderr + before.stderr
    carol, dave = after.stdout.strip(), before.stdout.strip()
    assert carol.startswith("tml-") and dave.startswith("tml-") and carol != dave
    assert carol not in after.stderr and "shown only now" in after.stderr
    listed = keys("keys", "list", f"run.dir={run_dir}")
    assert listed.returncode == 0 and set(listed.stdout.split()) >= {"carol", "dave"}
    assert carol not in listed.stdout
    bad = keys("keys", "add", "no spaces allowed", f"run.dir={run_dir}")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "error:" in bad.stderr
    srv = InProcessServer(run_dir)
    try:
        for key in (carol, dave):
            rest = tinker.RestClient(base_url=srv.url, api_key=key)
            assert rest.list_training_runs().result().training_runs == []
        with pytest.raises(tinker.AuthenticationError, match="not known to this server"):
            tinker.RestClient(base_url=srv.url, api_key="tml-not-a-key-of-this-server")
    finally:
        srv.close()
