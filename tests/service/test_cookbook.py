"""``tinker-cookbook`` 0.6.1 (installed by ``make setup`` without its unpublished
``tml-renderers``) trains through the service, saves every 2 steps and, run again with
the same ``log_path`` after an interruption, resumes from its last saved state."""

from __future__ import annotations

import json

import pytest

from tests import forkserver
from tests.service.helpers import InProcessServer, client_env
from veoptim.data import bundled_tokenizer_dir

pytestmark = pytest.mark.slow

pytest.importorskip("tinker_cookbook")
TOKENIZER = str(bundled_tokenizer_dir().resolve())


def cookbook(srv: InProcessServer, log_path, steps: int, cwd) -> str:
    """``python -m tests.service.cookbook_driver`` (forked from the preloaded server of
    ``tests/forkserver.py``); its output."""
    proc = forkserver.run_module(
        "tests.service.cookbook_driver", [srv.url, TOKENIZER, str(log_path), str(steps)],
        cwd=cwd, env=client_env(srv.keys["alice"]), timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_the_cookbook_trains_saves_and_resumes(tmp_path):
    srv = InProcessServer(
        tmp_path / "serve", f"serve.base_model={TOKENIZER}", "data.max_seq_len=128"
    )
    try:
        log_path = tmp_path / "cookbook"
        cookbook(srv, log_path, 5, tmp_path)
        saves = [
            json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()
        ]
        assert [s["name"] for s in saves] == ["000002", "000004", "final"]
        nll = [
            json.loads(line)["train_mean_nll"]
            for line in (log_path / "metrics.jsonl").read_text().splitlines()
        ]
        assert len(nll) == 5 and nll[-1] < nll[0]
        # Interrupted after the save at step 4: the next run resumes from it.
        lines = (log_path / "checkpoints.jsonl").read_text().splitlines()
        (log_path / "checkpoints.jsonl").write_text("\n".join(lines[:2]) + "\n")
        out = cookbook(srv, log_path, 5, tmp_path)
        assert f"Resumed training from {saves[1]['state_path']}" in out
        assert "Training completed successfully" in out
        _, runs = srv.service.db.runs(srv.tenant_id("alice"), 100, 0)
        assert runs == 2  # the resumed run is a new model, loaded with optimizer state
    finally:
        srv.close()
