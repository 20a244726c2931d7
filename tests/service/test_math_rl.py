"""``tinker_cookbook.recipes.math_rl.train`` (env ``arithmetic``, loss ``importance_sampling``)
through a server process for two tenants at once: each samples, is rewarded and trains;
the server is killed with SIGKILL mid-run and started again on the same run dir and port;
the recipes fail (they do not hang) and, run again with the same ``log_path``, resume from
their last saved state and finish."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.service.helpers import TENANTS, SubprocessServer, client_env
from veoptim.data import bundled_tokenizer_dir

pytest.importorskip("tinker_cookbook")
pytest.importorskip("math_verify")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]
TOKENIZER = str(bundled_tokenizer_dir().resolve())
STEPS = 8
SERVER = [f"serve.base_model={TOKENIZER}", "data.max_seq_len=256", "lora.num_slots=8"]


def recipe(srv: SubprocessServer, tenant: str, log_path: Path) -> forkserver.ForkedModule:
    """The recipe as ``python -m tests.service.math_rl_driver`` (forked from the preloaded
    server of ``tests/forkserver.py``), its output in :func:`output`."""
    env = client_env(srv.keys[tenant])
    args = [f"model_name={TOKENIZER}", "env=arithmetic", "renderer_name=role_colon",
            "loss_fn=importance_sampling", f"base_url={srv.url}", f"log_path={log_path}",
            "groups_per_batch=4", "group_size=4", f"max_steps={STEPS}", "lora_rank=8",
            "save_every=2", "eval_every=0", "learning_rate=1e-3",
            "behavior_if_log_dir_exists=resume"]  # fmt: skip
    out = output_path(log_path)
    out.unlink(missing_ok=True)
    return forkserver.ForkedModule("tests.service.math_rl_driver", args, cwd=log_path.parent,
                                   env=env, stdout=out)  # fmt: skip


def output_path(log_path: Path) -> Path:
    return log_path.parent / f"{log_path.name}.out"


def finished(proc: forkserver.ForkedModule, log_path: Path) -> str:
    """Wait for the recipe's process; its output."""
    proc.wait(timeout=300)
    return output_path(log_path).read_text()


def saved(log_path: Path) -> list[dict]:
    path = log_path / "checkpoints.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_math_rl_for_two_tenants_survives_a_server_restart(tmp_path):
    logs = {tenant: tmp_path / tenant for tenant in TENANTS}
    first = SubprocessServer(tmp_path / "serve", *SERVER)
    try:
        runs = {tenant: recipe(first, tenant, logs[tenant]) for tenant in TENANTS}
        deadline = time.monotonic() + 240
        while not all(saved(log) for log in logs.values()):
            assert time.monotonic() < deadline, "no tenant saved a state in 240 s"
            for tenant, proc in runs.items():
                assert proc.poll() is None, f"{tenant}: {finished(proc, logs[tenant])[-3000:]}"
            time.sleep(0.05)
    finally:
        first.kill()
    before = {tenant: saved(log)[-1] for tenant, log in logs.items()}
    assert all(last["name"] != "final" for last in before.values()), "finished before the kill"

    second = SubprocessServer(tmp_path / "serve", *SERVER, keys=first.keys,
                              port=int(first.url.rsplit(":", 1)[1]))  # fmt: skip
    try:
        for tenant, proc in runs.items():  # the clients of the killed server fail, never hang
            output = finished(proc, logs[tenant])
            assert proc.returncode != 0, f"{tenant} finished across the restart: {output[-2000:]}"
            assert "restarted" in output, output[-2000:]  # a request's error or its lost model
        resumed = {tenant: recipe(second, tenant, logs[tenant]) for tenant in TENANTS}
        for tenant, proc in resumed.items():
            output = finished(proc, logs[tenant])
            assert proc.returncode == 0, f"{tenant}: {output[-3000:]}"
            last = saved(logs[tenant])
            resumed_from = next(r for r in last if r["batch"] == before[tenant]["batch"])
            assert f"Resumed training from {before[tenant]['state_path']}" in output
            assert resumed_from["state_path"] == before[tenant]["state_path"]
            assert last[-1]["name"] == "final" and "Training completed successfully" in output
            rows = [json.loads(line)
                    for line in (logs[tenant] / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
            rewards = {row["step"]: row["env/all/reward/total"] for row in rows
                       if "env/all/reward/total" in row}  # fmt: skip
            assert sorted(rewards) == list(range(STEPS)), f"{tenant}: {sorted(rewards)}"
        assert second.terminate() == 0
    finally:
        second.kill()
