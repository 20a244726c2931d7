"""SIGTERM drains a real server process: ``healthz`` answers 503 ``draining``, new sessions,
models and requests are refused 503, and a request already queued and runnable completes
(within ``serve.drain_timeout_s``) instead of failing. The worker is held inside a save
(``tests/service/killing_serve.py``) so that the requests are certainly queued when the
signal comes."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.helpers import BASE_MODEL, SubprocessServer, datum
from tests.service.test_bad_inputs import PROTO, fwd_body

pytestmark = [pytest.mark.starts_processes, pytest.mark.filterwarnings("ignore::FutureWarning")]
WAIT_S = 60.0


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {WAIT_S} s"
        time.sleep(0.02)


def result(http: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(30):  # each poll waits up to serve.poll_timeout_s
        response = http.post("/retrieve_future", json={"request_id": request_id})
        if response.headers["content-type"] == "application/x-protobuf":
            return {"protobuf": response.content}
        answer = response.json()
        if answer.get("type") != "try_again":
            return answer
    raise TimeoutError(request_id)


def queued_model(http: httpx.Client) -> tuple[str, str]:
    """A session and a model of alice's, trained one forward_backward (seq_id 1)."""
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]
    created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0,
                                               "base_model": BASE_MODEL,
                                               "lora_config": {"rank": 2}}).json()  # fmt: skip
    model = result(http, created["request_id"])["model_id"]
    first = http.post("/forward_backward", content=fwd_body(model, 1, [datum([1, 2, 3])], False),
                      headers=PROTO).json()  # fmt: skip
    assert "protobuf" in result(http, first["request_id"])
    return session, model


def test_sigterm_drains_refusing_new_work_and_finishing_the_queued(tmp_path):
    release = tmp_path / "release"
    srv = SubprocessServer(tmp_path / "run", pause_at=f"written:1:{release}")
    try:
        with srv.http("alice") as http:
            session, model = queued_model(http)
            save = http.post("/save_weights", json={"model_id": model, "seq_id": 2, "path": "s"})
            wait_for(Path(f"{release}.reached").exists, "the save reaching its pause")
            body = fwd_body(model, 3, [datum([4, 5, 6, 7])], False)
            queued = http.post("/forward_backward", content=body, headers=PROTO)
            assert queued.status_code == 200  # queued behind the paused save, runnable after it
            health = http.get("/healthz")
            assert (health.status_code, health.json()["status"]) == (200, "ok")
            srv.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: http.get("/healthz").status_code == 503, "healthz answering 503")
            assert http.get("/healthz").json()["status"] == "draining"
            refused = {
                "create_session": http.post("/create_session", json={"tags": []}),
                "create_model": http.post(
                    "/create_model",
                    json={
                        "session_id": session,
                        "model_seq_id": 1,
                        "base_model": BASE_MODEL,
                        "lora_config": {"rank": 2},
                    },
                ),  # fmt: skip
                "create_sampling_session": http.post(
                    "/create_sampling_session",
                    json={
                        "session_id": session,
                        "sampling_session_seq_id": 0,
                        "base_model": BASE_MODEL,
                    },
                ),  # fmt: skip
                "forward_backward": http.post(
                    "/forward_backward", content=fwd_body(model, 4, [datum([1, 2])]), headers=PROTO
                ),  # fmt: skip
            }
            for name, response in refused.items():
                assert response.status_code == 503, (name, response.text)
                assert "draining" in response.json()["detail"], name
            release.touch()
            assert result(http, save.json()["request_id"])["path"].endswith("/weights/s")
            assert "protobuf" in result(http, queued.json()["request_id"])  # ran, not failed
        assert srv.proc.wait(WAIT_S) == 0
    finally:
        release.touch()
        srv.kill()
