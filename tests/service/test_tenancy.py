"""Where a regression would open one tenant to another: every route but ``healthz``
refuses a missing or unknown key (the app's routes enumerated), a key differing only in
its last characters is unknown, a replaced key stops working, and tenant B naming tenant
A's live model, finished request or session gets *not found* and changes nothing of A's."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import httpx
import pytest
import tinker
from fastapi.routing import APIRoute
from starlette.testclient import TestClient

from tests import forkserver
from tests.conftest import REPO
from tests.service.helpers import BASE_MODEL, differences, examples, train_step
from tests.service.test_bad_inputs import PROTO, fwd_body
from veoptim.service.app import create_app

pytestmark = [
    pytest.mark.starts_processes,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning"),
]
#: The routes a request without a key reaches: healthz. (A signed download link takes no
#: key either, but refuses a request without a valid signature the same way.)
PUBLIC = {"/api/v1/healthz"}


def concrete(path: str) -> str:
    """A route's path with every parameter filled in."""
    return re.sub(r"\{[^}]+\}", "x", path)


def unguarded(app: Any) -> list[str]:
    """'METHOD path (status)' of every route of ``app`` (but :data:`PUBLIC`) that answers
    a request without a key, or with an unknown key, other than 401."""
    found = []
    unknown = {"X-API-Key": "tml-" + "z" * 40}
    with TestClient(app) as client:
        for route in app.routes:
            if not isinstance(route, APIRoute) or route.path in PUBLIC:
                continue
            for method in sorted(route.methods):
                for headers in ({}, unknown):
                    response = client.request(
                        method, concrete(route.path), headers=headers, json={}
                    )
                    if response.status_code != 401:
                        found.append(f"{method} {route.path} ({response.status_code})")
    return found


def test_every_route_but_healthz_refuses_a_missing_or_unknown_key(server):
    app = create_app(server.service)
    assert len([r for r in app.routes if isinstance(r, APIRoute)]) >= 24  # not vacuous
    assert unguarded(app) == []
    with TestClient(app) as client:
        assert client.get("/api/v1/healthz").status_code == 200


def test_the_enumeration_finds_a_route_that_forgot_the_tenant(server):
    """Negative control: a route added without the tenant dependency is reported."""
    app = create_app(server.service)

    async def forgot() -> dict[str, str]:
        return {}

    app.router.add_api_route("/api/v1/forgot", forgot, methods=["GET"])
    assert unguarded(app) == ["GET /api/v1/forgot (200)", "GET /api/v1/forgot (200)"]


def test_routes_are_module_functions_of_the_routes_package():
    app_routes = [r for r in create_app.__globals__["ROUTERS"] for r in r.routes]
    for route in app_routes:
        endpoint = route.endpoint
        assert endpoint.__module__.startswith("veoptim.service.routes."), endpoint
        assert endpoint.__qualname__ == endpoint.__name__, f"{endpoint.__qualname__} is nested"


def test_a_key_that_differs_only_in_its_last_characters_is_refused(server):
    key = server.keys["alice"]
    for near in (
        key[:-1] + ("0" if key[-1] != "0" else "1"),
        key[:-4] + "abcd",
        key + "x",
        key[:-1],
    ):
        with httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": near}) as http:
            response = http.get("/get_server_capabilities")
            assert response.status_code == 401, near
            assert "not known" in response.json()["detail"]
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key=key[:-2] + "zz").get_server_capabilities()


def add_key(server, name: str) -> str:
    """``veoptim-serve keys add NAME`` on the running server's run dir; the new key."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = forkserver.run_module("tasks.serve", ["keys", "add", name, f"run.dir={server.run_dir}"],
                                 cwd=REPO, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def status(server, key: str) -> int:
    with httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}) as http:
        return http.get("/get_server_capabilities").status_code


def test_a_replaced_key_is_refused_and_the_new_one_works(server):
    """``keys add NAME`` for an existing tenant gives it a new key: the new key works at
    once, the old one is refused (at once once the new key was used, else from the
    server's next read of the keys, within a second or two)."""
    first = add_key(server, "carol")
    assert status(server, first) == 200
    second = add_key(server, "carol")
    assert status(server, second) == 200
    assert status(server, first) == 401
    third = add_key(server, "carol")  # the old key first this time
    deadline = time.monotonic() + 10
    while status(server, second) != 401:
        assert time.monotonic() < deadline, "the replaced key still works"
        time.sleep(0.1)
    assert status(server, third) == 200


# ---------------------------------------------------------------------- another tenant's things
@pytest.fixture
def alices(server):
    """Alice's live model, trained one step, and a finished request of hers."""
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=11).result()
    train_step(tc, examples(tc.get_tokenizer(), 2))
    with server.http("alice") as http:
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        info = http.post("/unload_model", json={"model_id": "nothing"})  # a refused one
        assert info.status_code == 404
    yield {"sc": sc, "tc": tc, "session": session}
    sc.close("success").result()


def test_tenant_b_naming_tenant_as_live_model_gets_404_and_changes_nothing(server, alices):
    model = alices["tc"].model_id
    slot = server.slot_of(model)
    before = server.trainer.slot_state(slot)
    calls = {
        "get_info": lambda h: h.post("/get_info", json={"model_id": model}),
        "forward_backward": lambda h: h.post(
            "/forward_backward", content=fwd_body(model, 50, [_datum()], False), headers=PROTO
        ),
        "optim_step": lambda h: h.post(
            "/optim_step", json={"model_id": model, "seq_id": 50, "adam_params": {}}
        ),
        "save_weights": lambda h: h.post(
            "/save_weights", json={"model_id": model, "seq_id": 50, "path": "mine"}
        ),
        "save_weights_for_sampler": lambda h: h.post(
            "/save_weights_for_sampler", json={"model_id": model, "seq_id": 50, "path": "mine"}
        ),
        "unload_model": lambda h: h.post("/unload_model", json={"model_id": model}),
    }
    with server.http("bob") as bob:
        for name, call in calls.items():
            response = call(bob)
            assert response.status_code == 404, (name, response.text)
            assert "not a model of this tenant" in response.json()["detail"], name
    assert server.slot_of(model) == slot
    assert differences(before, server.trainer.slot_state(slot)) == []
    assert train_step(alices["tc"], examples(alices["tc"].get_tokenizer(), 2)) > 0  # still hers


def _datum() -> Any:
    from tests.service.helpers import datum

    return datum([1, 2, 3, 4])


def test_tenant_b_cannot_retrieve_tenant_as_finished_request(server, alices):
    with server.http("alice") as http:
        model = alices["tc"].model_id
        probe = http.post(
            "/optim_step", json={"model_id": model, "seq_id": 10**9, "adam_params": {}}
        )
        seq = int(re.search(r"expected (\d+) to", probe.json()["detail"]).group(1))
        body = fwd_body(model, seq, [_datum()])
        request_id = http.post("/forward_backward", content=body, headers=PROTO).json()[
            "request_id"
        ]
        mine = http.post("/retrieve_future", json={"request_id": request_id})
        assert mine.headers["content-type"] == "application/x-protobuf"  # finished, still held
    with server.http("bob") as bob:
        theirs = bob.post("/retrieve_future", json={"request_id": request_id})
        assert theirs.status_code == 404 and "not a request of this tenant" in theirs.text
    with server.http("alice") as http:  # still alice's to read
        again = http.post("/retrieve_future", json={"request_id": request_id})
        assert again.content == mine.content


def test_tenant_b_naming_tenant_as_session_is_refused_and_creates_nothing(server, alices):
    session = alices["session"]
    models_before = set(server.service.engine.models)
    runs_before = {
        name: server.service.db.runs(server.tenant_id(name), 1000, 0)[1]
        for name in ("alice", "bob")
    }
    calls = {
        "create_model": lambda h: h.post(
            "/create_model",
            json={
                "session_id": session,
                "model_seq_id": 7,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 2},
            },
        ),  # fmt: skip
        "create_sampling_session": lambda h: h.post(
            "/create_sampling_session",
            json={"session_id": session, "sampling_session_seq_id": 7, "base_model": BASE_MODEL},
        ),  # fmt: skip
        "session_heartbeat": lambda h: h.post("/session_heartbeat", json={"session_id": session}),
        "load_weights": lambda h: h.post(
            "/load_weights",
            json={
                "session_id": session,
                "model_seq_id": 8,
                "optimizer": False,
                "path": f"tinker://{alices['tc'].model_id}/weights/none",
            },
        ),  # fmt: skip
        "finish": lambda h: h.post(f"/sessions/{session}/finish", json={"reason": {"type": "x"}}),
    }
    with server.http("bob") as bob:
        for name, call in calls.items():
            response = call(bob)
            assert response.status_code == 404, (name, response.text)
            assert "not a session of this tenant" in response.json()["detail"], name
    assert set(server.service.engine.models) == models_before
    assert {
        name: server.service.db.runs(server.tenant_id(name), 1000, 0)[1]
        for name in ("alice", "bob")
    } == runs_before
    bob_id = server.tenant_id("bob")
    assert server.service.db.sampler(bob_id, f"{session}:sample:7") is None
    assert server.service.db.sampler(server.tenant_id("alice"), f"{session}:sample:7") is None
    with server.http("alice") as http:  # alice's session is still open and hers
        assert http.post("/session_heartbeat", json={"session_id": session}).status_code == 200
