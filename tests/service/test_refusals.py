"""Every refusal in order: a refused request still takes its place in its model's
``seq_id`` order (the client's next request answers at once), values the trainer cannot
take are a 400 naming the field, a model whose creation failed leaves nothing behind,
and no message a tenant reads names a server path or a slot-store entry."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.service.helpers import BASE_MODEL, datum, differences, examples, train_step
from tests.service.test_bad_inputs import PROTO, RAW, SDK, fwd_body, live, raw_case, sdk_case

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
__all__ = ["live"]  # the fixture of test_bad_inputs, used here too
#: The next request after a refusal must not wait for a seq_id that never comes: the
#: servers of these tests fail a request after serve.seq_gap_timeout_s=10 of waiting.
AT_ONCE_S = 5.0


def states(server) -> dict[int, Any]:
    return {s: server.trainer.slot_state(s) for s in sorted(server.trainer.slots)}


def unchanged(server, before: dict[int, Any]) -> bool:
    after = states(server)
    return sorted(after) == sorted(before) and all(
        differences(before[s], after[s]) == [] for s in before
    )


@pytest.fixture
def trainee(server):
    """A fresh SDK training client of alice's, trained one step."""
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
    tokenizer = tc.get_tokenizer()
    train_step(tc, examples(tokenizer, 2))
    yield sc, tc, tokenizer
    sc.close("success").result()


def image_datum(tokens: list[int]) -> types.Datum:
    chunks = [types.EncodedTextChunk(tokens=tokens[:2]),
              types.ImageChunk(data=b"\x89PNG....", format="png")]  # fmt: skip
    n = len(tokens[:2]) + 1
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": np.ones(n, np.int64),
                                       "weights": np.ones(n, np.float32)})  # fmt: skip


BAD_LOADS = {
    "tinker://../../etc": lambda tc, tok: tc.load_state("tinker://../../etc").result(),
    "/etc/passwd": lambda tc, tok: tc.load_state("/etc/passwd").result(),
    "an image chunk": lambda tc, tok: tc.forward_backward(
        [image_datum(tok.encode("User: hi"))], "cross_entropy"
    ).result(),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_after_a_request_refused_by_the_sdk_the_next_one_answers_at_once(server, trainee, case):
    sc, tc, tok = trainee
    with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)):
        BAD_LOADS[case](tc, tok)
    began = time.monotonic()
    assert train_step(tc, examples(tok, 2)) > 0  # on a server that lost the seq_id: fails
    assert time.monotonic() - began < AT_ONCE_S


def test_after_a_body_that_does_not_validate_the_next_request_answers_at_once(server, trainee):
    sc, tc, tok = trainee
    model = tc.model_id
    with server.http("alice") as http:
        seq = next_seq(http, model)
        bad = {"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": "fast"}}
        refused = http.post("/optim_step", json=bad)
        assert refused.status_code == 400
        assert "adam_params.learning_rate" in refused.json()["detail"]
        began = time.monotonic()
        body = fwd_body(model, seq + 1, examples(tok, 1))
        answer = http.post("/forward_backward", content=body, headers=PROTO).json()
        result = retrieve(http, answer["request_id"])
        assert "error" not in result, result
        assert time.monotonic() - began < AT_ONCE_S


def next_seq(http: httpx.Client, model_id: str) -> int:
    """The model's next seq_id, found by a refused probe (the SDK's own counter is
    private): a seq_id far ahead is refused naming the range that starts there."""
    probe = http.post("/optim_step", json={"model_id": model_id, "seq_id": 10**9,
                                           "adam_params": {}})  # fmt: skip
    found = re.search(r"expected (\d+) to", probe.json()["detail"])
    assert found, probe.text
    return int(found.group(1))


def retrieve(http: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(20):
        response = http.post("/retrieve_future", json={"request_id": request_id})
        if response.headers["content-type"] == "application/x-protobuf":
            return {"protobuf": response.content}
        answer = response.json()
        if answer.get("type") != "try_again":
            return answer
    raise TimeoutError(request_id)


def test_a_seed_beyond_the_generators_range_is_a_400_naming_lora_config_seed(server):
    sc = server.client("alice")
    before = states(server)
    with pytest.raises(tinker.APIStatusError) as caught:
        sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2**70).result()
    assert caught.value.status_code == 400 and "lora_config.seed" in str(caught.value.body)
    assert unchanged(server, before)
    sc.close("success").result()


def test_a_body_nested_100k_levels_deep_is_a_400_naming_the_body(server):
    deep = b'{"model_id": ' + b"[" * 100_000 + b"]" * 100_000 + b', "seq_id": 1}'
    with server.http("alice") as http:
        for path in ("/optim_step", "/create_session", "/asample", "/retrieve_future"):
            response = http.post(path, content=deep, headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (path, response.text)
            assert "body is not valid JSON" in response.json()["detail"]
        assert http.get("/healthz").status_code == 200


def test_a_model_whose_creation_failed_leaves_nothing_behind(server):
    """Every slot taken: the creation fails naming lora.num_slots, and the model id it
    would have had is unknown afterwards (get_info 404, no request accepted)."""
    holder = server.client("bob")
    free = server.trainer.num_slots - server.service.slots.training()
    taken = [holder.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
             for _ in range(free)]  # fmt: skip
    assert len(taken) == free
    with server.http("alice") as http:
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        model_id = f"{session}:train:0"
        created = http.post("/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
            "lora_config": {"rank": 2}}).json()  # fmt: skip
        failed = retrieve(http, created["request_id"])
        assert failed["category"] == "user" and "lora.num_slots" in failed["error"]
        info = http.post("/get_info", json={"model_id": model_id})
        assert info.status_code == 404, info.text
        step = http.post("/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
        assert step.status_code == 404, step.text
        runs = http.get("/training_runs").json()["training_runs"]
        assert model_id not in [r["training_run_id"] for r in runs]
        http.post(f"/sessions/{session}/finish", json={"reason": {"type": "success"}})
    holder.close("success").result()


@pytest.mark.parametrize("name", ["advantages", "logprobs", "weights"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_loss_input_with_one_non_finite_value_is_a_4xx_naming_it(server, trainee, name, bad):
    sc, tc, tok = trainee
    ids = tok.encode("User: Uppercase abc\nAssistant: ABC")
    n = len(ids) - 1
    inputs = {"target_tokens": np.array(ids[1:], np.int64)}
    loss = "cross_entropy" if name == "weights" else "importance_sampling"
    if loss == "cross_entropy":
        inputs["weights"] = np.ones(n, np.float32)
    else:
        inputs.update(logprobs=np.full(n, -1.0, np.float32), advantages=np.ones(n, np.float32))
    inputs[name] = inputs[name].copy()
    inputs[name][n // 2] = bad  # one among finite values
    bad_datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)
    before = states(server)
    with pytest.raises(tinker.APIStatusError) as caught:
        tc.forward_backward([bad_datum], loss).result()
    assert 400 <= caught.value.status_code < 500
    assert f"data[0].loss_fn_inputs['{name}']" in str(caught.value.body)
    assert unchanged(server, before)


@pytest.mark.parametrize("name", ["a/b", "x y", "ok..", "a\nb"])
def test_a_save_name_that_only_starts_validly_is_a_4xx_naming_it(server, trainee, name):
    sc, tc, tok = trainee
    before = states(server)
    with pytest.raises(tinker.APIStatusError) as caught:
        tc.save_state(name).result()
    assert 400 <= caught.value.status_code < 500
    assert repr(name) in caught.value.body["detail"], caught.value.body
    assert unchanged(server, before)
    assert train_step(tc, examples(tok, 2)) > 0  # and its seq_id is used


# ---------------------------------------------------------------------- what a tenant reads
PRIVATE_ENTRY = re.compile(r"\bc[0-9a-f]{20}\b")


def private_parts(server) -> list[str]:
    run_dir = Path(server.run_dir)
    return sorted({str(run_dir), str(run_dir.resolve()), str(server.trainer.store.root),
                   "checkpoints/slots", ".versions"})  # fmt: skip


def leaks(server, message: str) -> list[str]:
    found = [part for part in private_parts(server) if part in message]
    return found + PRIVATE_ENTRY.findall(message)


def truncated_copy(server, tc, name: str) -> str:
    """A training checkpoint of ``tc`` whose first tensor shard is cut in half."""
    path = tc.save_state(name).result().path
    shards = sorted((server.trainer.store.root / server.store_ref(path)).rglob("__*.raw"))
    target = shards[0].resolve()
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    return path


def every_refusal(server, live: dict[str, Any], sc, tc) -> list[str]:
    """The message of every bad request the suite knows (HTTP detail or failed future)."""
    messages = []
    for name in RAW:
        messages.append(raw_case(name, live)[1])
    for name in SDK:
        try:
            sdk_case(name, live)
        except (tinker.APIStatusError, tinker.RequestFailedError) as exc:
            messages.append(json.dumps(getattr(exc, "body", None)) + str(exc))
    sampler_path = tc.save_weights_for_sampler("s").result().path
    truncated = truncated_copy(server, tc, "t")
    for action in (
        lambda: tc.load_state_with_optimizer(sampler_path).result(),
        lambda: tc.load_state(truncated).result(),
        lambda: sc.create_training_client_from_state(truncated).result(),
        lambda: tc.load_state("tinker://../../etc").result(),
        lambda: tc.save_state("a/b").result(),
        lambda: tc.forward_backward([datum([1, 2, 10**6])], "cross_entropy").result(),
    ):
        with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as caught:
            action()
        messages.append(json.dumps(getattr(caught.value, "body", None)) + str(caught.value))
    return messages


def test_no_message_to_a_tenant_names_a_server_path_or_store_entry(server, live):
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
    train_step(tc, examples(tc.get_tokenizer(), 2))
    messages = every_refusal(server, live, sc, tc)
    assert len(messages) >= len(RAW) + len(SDK) + 6
    assert any("failed" in m for m in messages)  # the truncated load's reason is kept
    found = {m: leaks(server, m) for m in messages if leaks(server, m)}
    assert found == {}
    sc.close("success").result()


def test_the_leak_check_sees_a_path_and_an_entry(server):
    """Negative control of :func:`leaks`."""
    entry = "c" + "0123456789abcdef0123"
    assert leaks(server, f"checkpoint {server.trainer.store.root}/{entry} is damaged")
    assert leaks(server, f"entry {entry} is gone") == [entry]
    assert leaks(server, "path: checkpoint tinker://x:train:0/weights/t was not found.") == []
