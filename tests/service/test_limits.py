"""Limits and housekeeping over raw HTTP: body size, unfinished requests per tenant,
unload_model and a session whose heartbeats stopped free their slots, per-slot metrics in
metrics.jsonl."""

from __future__ import annotations

import json
import time

import pytest

from tests.service.helpers import BASE_MODEL, InProcessServer, datum
from tests.service.test_bad_inputs import PROTO, fwd_body


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    served = InProcessServer(
        tmp_path_factory.mktemp("limits"), "serve.session_timeout_s=4",
        "serve.max_request_bytes=4096", "serve.max_futures_per_tenant=3",
    )  # fmt: skip
    yield served
    served.close()


def result(http, request_id: str) -> dict:
    for _ in range(20):  # each poll waits up to serve.poll_timeout_s
        response = http.post("/retrieve_future", json={"request_id": request_id})
        if response.headers["content-type"] == "application/x-protobuf":
            return {"protobuf": response.content}  # a ForwardBackwardOutput
        answer = response.json()
        if answer.get("type") != "try_again":
            return answer
    raise TimeoutError(request_id)


def test_limits_sessions_and_metrics(small):
    with small.http("alice") as http:
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        created = http.post("/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
            "lora_config": {"rank": 2},
        }).json()  # fmt: skip
        model = result(http, created["request_id"])["model_id"]

        def post(path: str, **kwargs):  # the session stays alive while the test runs
            http.post("/session_heartbeat", json={"session_id": session})
            return http.post(path, **kwargs)

        assert http.get("/healthz").json()["slots_used"] == 1

        big = post("/forward_backward", content=b"x" * 5000, headers=PROTO)
        assert big.status_code == 413 and "serve.max_request_bytes" in big.json()["detail"]

        waiting = []
        for seq in (3, 4, 5):  # waiting for seq_ids 1 and 2: unfinished
            body = fwd_body(model, seq, [datum([1, 2, 3])])
            waiting.append(post("/forward_backward", content=body, headers=PROTO).json())
        body = fwd_body(model, 6, [datum([1, 2, 3])])
        refused = post("/forward_backward", content=body, headers=PROTO)
        assert refused.status_code == 400
        assert "serve.max_futures_per_tenant" in refused.json()["detail"]
        # seq_ids 1 and 2 arrive: the waiting requests run in order.
        for seq, forward_only in ((1, False), (2, True)):
            body = fwd_body(model, seq, [datum([1, 2, 3])], forward_only=forward_only)
            answer = post("/forward_backward", content=body, headers=PROTO).json()
            assert result(http, answer["request_id"]).get("error") is None
        assert all(result(http, w["request_id"]).get("error") is None for w in waiting)
        step = post("/optim_step", json={"model_id": model, "seq_id": 7, "adam_params": {}})
        assert "error" not in result(http, step.json()["request_id"])

        second = post("/create_model", json={
            "session_id": session, "model_seq_id": 1, "base_model": BASE_MODEL,
            "lora_config": {"rank": 2},
        }).json()  # fmt: skip
        other = result(http, second["request_id"])["model_id"]
        assert http.get("/healthz").json()["slots_used"] == 2
        unloaded = post("/unload_model", json={"model_id": other}).json()
        assert result(http, unloaded["request_id"]) == {"model_id": other, "type": "unload_model"}
        assert http.get("/healthz").json()["slots_used"] == 1

        deadline = time.monotonic() + 15  # no heartbeat: the session expires, the slot frees
        while http.get("/healthz").json()["slots_used"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert http.get("/healthz").json() == {
            "status": "ok",
            "slots_used": 0,
            "slots_free": 4,
            "ranks": 1,
        }
        late = http.post("/optim_step", json={"model_id": model, "seq_id": 8, "adam_params": {}})
        assert late.status_code == 400 and "unloaded" in late.json()["detail"]
        # The expired session is gone: 410, the answer that stops the SDK's heartbeat loop
        # (any other status makes it retry, and warn, for as long as the process lives).
        beat = http.post("/session_heartbeat", json={"session_id": session})
        assert beat.status_code == 410, beat.text
        assert beat.json()["detail"] == f"session_id {session!r} is finished (expired)."
        reuse = http.post("/create_model", json={
            "session_id": session, "model_seq_id": 2, "base_model": BASE_MODEL,
            "lora_config": {"rank": 2},
        })  # fmt: skip
        assert reuse.status_code == 410 and "is finished" in reuse.json()["detail"]

    lines = [
        json.loads(line) for line in (small.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    ops = [line["op"] for line in lines if line["model"] == model]
    assert ops[:2] == ["forward_backward", "forward"] and "optim_step" in ops
    assert all(isinstance(line["slot"], int) for line in lines)
