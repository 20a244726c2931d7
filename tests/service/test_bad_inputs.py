"""Every bad input is a 4xx whose detail names the field, and no slot changes: checked
against the slot state of every live slot of a server in this process."""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.service.helpers import BASE_MODEL, datum, differences, examples, train_step

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def live(server):
    """A trained SDK model (its client keeps working) and a second one driven by raw HTTP."""
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    tokenizer = tc.get_tokenizer()
    train_step(tc, examples(tokenizer, 2))
    raw = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
    http = server.http("alice")
    ctx = {"sc": sc, "tc": tc, "tok": tokenizer, "raw": raw.model_id, "seq": [1], "http": http}
    yield ctx
    http.close()
    sc.close("success").result()


def states(server) -> dict[int, Any]:
    return {s: server.trainer.slot_state(s) for s in sorted(server.trainer.slots)}


def fwd_body(model_id: str, seq_id: int, data: list[types.Datum], forward_only=True) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id,
    )  # fmt: skip
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


def raw_case(name: str, live: dict[str, Any]) -> tuple[int, str]:
    http, model, seq = live["http"], live["raw"], live["seq"]
    good = [datum([1, 2, 3, 4])]
    if name == "malformed protobuf":
        r = http.post("/forward_backward", content=b"\x0a\xff\xff\xff\x0f", headers=PROTO)
    elif name == "malformed JSON":
        r = http.post("/optim_step", content=b"{oops", headers={"Content-Type": "application/json"})
    elif name == "unknown model id":
        r = http.post(
            "/optim_step", json={"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}}
        )
    elif name == "repeated seq_id":
        ok = http.post("/forward_backward", content=fwd_body(model, seq[0], good), headers=PROTO)
        assert ok.status_code == 200, ok.text
        r = http.post("/optim_step", json={"model_id": model, "seq_id": seq[0], "adam_params": {}})
        seq[0] += 1
    elif name == "out-of-order seq_id":
        r = http.post(
            "/forward_backward", content=fwd_body(model, seq[0] + 10**6, good), headers=PROTO
        )
    elif name == "negative learning rate":
        body = {"model_id": model, "seq_id": seq[0], "adam_params": {"learning_rate": -1.0}}
        r = http.post("/optim_step", json=body)
        seq[0] += 1  # a refused request uses up its seq_id
    else:
        raise AssertionError(name)
    return r.status_code, r.json()["detail"]


RAW = {
    "malformed protobuf": ("ForwardBackwardRequest protobuf",),
    "malformed JSON": ("not valid JSON",),
    "unknown model id": ("model_id", "nope:train:0"),
    "repeated seq_id": ("seq_id", "already used"),
    "out-of-order seq_id": ("seq_id", "out of order"),
    "negative learning rate": ("adam_params.learning_rate",),
}


@pytest.mark.parametrize("name", list(RAW))
def test_a_bad_raw_request_is_a_4xx_naming_the_field_and_changes_no_slot(server, live, name):
    before = states(server)
    status, detail = raw_case(name, live)
    assert 400 <= status < 500
    for word in RAW[name]:
        assert word in detail, detail
    after = states(server)
    assert sorted(after) == sorted(before)
    assert all(differences(before[s], after[s]) == [] for s in before)


def sdk_case(name: str, live: dict[str, Any]) -> Any:
    sc, tc, tok = live["sc"], live["tc"], live["tok"]
    ids = tok.encode("User: Uppercase abc\nAssistant: ABC")
    n = len(ids) - 1
    if name == "token id outside the vocabulary":
        return tc.forward_backward([datum([*ids[:-1], 10**6, ids[-1]])], "cross_entropy").result()
    if name == "target token outside the vocabulary":
        bad = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                          loss_fn_inputs={"target_tokens": np.full(n, 10**6, np.int64),
                                          "weights": np.ones(n, np.float32)})  # fmt: skip
        return tc.forward_backward([bad], "cross_entropy").result()
    if name == "weights of another length":
        return tc.forward_backward([datum(ids, [1.0] * (n + 1))], "cross_entropy").result()
    if name == "a datum longer than the context":
        return tc.forward_backward([datum(list(range(3, 3 + 80)))], "cross_entropy").result()
    if name == "unsupported loss":
        return tc.forward_backward([datum(ids)], "dro").result()
    if name == "unknown base model":
        return sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    if name == "rank above lora.r":
        return sc.create_lora_training_client(base_model=BASE_MODEL, rank=64).result()
    if name == "train_attn off":
        return sc.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, train_attn=False
        ).result()
    raise AssertionError(name)


SDK = {
    "token id outside the vocabulary": ("data[0].model_input", "vocabulary"),
    "target token outside the vocabulary": ("target_tokens", "vocabulary"),
    "weights of another length": ("weights", "one value per input token"),
    "a datum longer than the context": ("data[0].model_input", "data.max_seq_len"),
    "unsupported loss": ("loss_fn", "dro", "cross_entropy"),
    "unknown base model": ("base_model", "Qwen/Qwen3-8B"),
    "rank above lora.r": ("lora_config.rank", "lora.r"),
    "train_attn off": ("lora_config.train_attn", "lora.target_modules"),
}


@pytest.mark.parametrize("name", list(SDK))
def test_a_bad_sdk_call_is_a_4xx_naming_the_field_and_changes_no_slot(server, live, name):
    before = states(server)
    with pytest.raises(tinker.APIStatusError) as caught:
        sdk_case(name, live)
    assert 400 <= caught.value.status_code < 500
    detail = json.dumps(caught.value.body)
    for word in SDK[name]:
        assert word in detail, detail
    after = states(server)
    assert sorted(after) == sorted(before)
    assert all(differences(before[s], after[s]) == [] for s in before)


def test_the_client_trains_on_after_refused_requests(server, live):
    """A refused request used up its seq_id: the next ones do not wait for it."""
    assert train_step(live["tc"], examples(live["tok"], 2)) > 0


def test_create_model_with_every_slot_taken_names_lora_num_slots(server, live):
    sc = server.client("bob")
    free = server.trainer.num_slots - len(server.trainer.slots)
    clients = [sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
               for _ in range(free)]  # fmt: skip
    assert len(server.trainer.slots) == server.trainer.num_slots
    before = states(server)
    with pytest.raises(tinker.RequestFailedError, match="lora.num_slots") as caught:
        sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    assert caught.value.category == types.RequestErrorCategory.User
    after = states(server)
    assert all(differences(before[s], after[s]) == [] for s in before)
    assert len(clients) == free
    sc.close("success").result()


def test_a_retried_submission_gets_its_first_future(server, live):
    """The SDK's transport retries a POST with the same X-Idempotency-Key: same future;
    another request on that seq_id is refused."""
    http, model, seq = live["http"], live["raw"], live["seq"]
    body = fwd_body(model, seq[0], [datum([1, 2, 3])])
    first = http.post(
        "/forward_backward", content=body, headers={**PROTO, "X-Idempotency-Key": "k1"}
    )
    again = http.post(
        "/forward_backward", content=body, headers={**PROTO, "X-Idempotency-Key": "k1"}
    )
    other = http.post(
        "/forward_backward", content=body, headers={**PROTO, "X-Idempotency-Key": "k2"}
    )
    seq[0] += 1
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert other.status_code == 400 and "already used" in other.json()["detail"]


def test_each_request_is_one_log_line_with_tenant_status_and_model_never_the_key(
    server, live, caplog
):
    caplog.set_level(logging.INFO, logger="veoptim.service")
    refused = live["http"].post(
        "/optim_step", json={"model_id": "nope", "seq_id": 1, "adam_params": {}}
    )
    with server.http(None) as anonymous:
        assert anonymous.get("/get_server_capabilities").status_code == 401
    assert refused.status_code == 404

    def logged() -> list[str]:  # this test's two requests (an earlier test's may follow)
        return [
            line
            for line in (r.getMessage() for r in caplog.records)
            if line.startswith("request ") and ("=nope " in line or "capabilities" in line)
        ]

    deadline = time.monotonic() + 10  # a line is written once its response went out
    while len(logged()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = logged()
    assert len(lines) == 2
    refused_line, anonymous_line = sorted(lines, key=lambda line: "optim_step" not in line)
    assert re.fullmatch(
        r"request tenant=alice endpoint=POST /api/v1/optim_step model=nope seq_id=- "
        r"status=404 ms=\d+\.\d", refused_line
    )  # fmt: skip
    assert re.fullmatch(
        r"request tenant=- endpoint=GET /api/v1/get_server_capabilities model=- seq_id=- "
        r"status=401 ms=\d+\.\d", anonymous_line
    )  # fmt: skip
    assert not any(key in line for key in server.keys.values() for line in lines)
