"""A server process killed with SIGKILL at three points — inside a save (its files written,
not published; a request waiting in its model's order), while training, and after a save
was published by the slot store but before the service recorded it — and started again on
the same run dir each time: the store entries of the interrupted saves are removed at
start, the recorded checkpoints are listed and loadable, the client
resumes from the last one and continues bit for bit like the uninterrupted run, the
request pending at the crash answers a server error, a sampling session of the killed
server samples its snapshot as before, and SIGTERM then exits 0."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tinker
from tinker import types

from tests.service.helpers import BASE_MODEL, SubprocessServer, datum, examples, train_step
from tests.service.test_bad_inputs import PROTO, fwd_body
from veoptim.service.db import DB_FILE, Database

pytestmark = [pytest.mark.starts_processes, pytest.mark.filterwarnings("ignore::FutureWarning")]


PROMPT = types.ModelInput.from_ints([1, 2, 3, 4, 5])
SEEDED = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)


def tokens_of(response: types.SampleResponse) -> list[list[int]]:
    return [s.tokens for s in response.sequences]


def logprob_bits(result) -> list[bytes]:
    return [
        np.asarray(o["logprobs"].to_numpy(), np.float32).tobytes() for o in result.loss_fn_outputs
    ]


def unrecorded(run_dir) -> set[str]:
    """The slot-store entries no checkpoint record names (a save a crash interrupted)."""
    database = Database(run_dir / DB_FILE)
    try:
        recorded = database.recorded_store_refs()
    finally:
        database.close()
    root = run_dir / "checkpoints" / "slots"
    on_disk = {p.name for p in root.iterdir() if p.is_dir()} if root.is_dir() else set()
    assert recorded <= on_disk  # every recorded checkpoint is there
    return on_disk - recorded


def test_a_restart_after_sigkill_lists_and_resumes_the_published_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    first = SubprocessServer(run_dir, kill_at="written:3")  # inside the third save, s3
    try:
        sc = first.client("alice")
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=9).result()
        data = examples(tc.get_tokenizer(), 3)
        for _ in range(3):
            train_step(tc, data)
        tc.save_state("s1").result()
        for _ in range(2):
            train_step(tc, data)
        resume = tc.save_state("s2").result().path
        uninterrupted = [
            train_step(tc, data),
            logprob_bits(tc.forward(data, "cross_entropy").result()),
        ]
        waiting = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        with first.http("alice") as http:  # seq_id 2 before 1: it waits in its model's order
            body = fwd_body(waiting.model_id, 2, [datum([1, 2, 3])])
            response = http.post("/forward_backward", content=body, headers=PROTO)
            assert response.status_code == 200
            pending = response.json()["request_id"]
        tc.save_state("s3")  # the server kills itself once s3's files are written
        first.wait_killed()
    finally:
        first.kill()

    assert len(unrecorded(run_dir)) == 1  # s3, written and never published
    second = SubprocessServer(run_dir, keys=first.keys)
    try:
        assert unrecorded(run_dir) == set()  # start-up removed it
        with second.http("alice") as http:
            answer = http.post("/retrieve_future", json={"request_id": pending}).json()
            assert answer["category"] == "server" and "restarted" in answer["error"]
            lost = http.post("/get_info", json={"model_id": tc.model_id})
            assert lost.status_code == 404 and "lost when this server restarted" in lost.text
            assert "create_training_client_from_state_with_optimizer" in lost.text
            with second.http("bob") as bobs:  # another tenant's model stays merely unknown
                other = bobs.post("/get_info", json={"model_id": tc.model_id})
                assert other.status_code == 404 and "restarted" not in other.text
        rest = tinker.RestClient(base_url=second.url, api_key=second.keys["alice"])
        names = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert names == ["weights/s1", "weights/s2"]  # s3 never published
        sc2 = second.client("alice")
        resumed = sc2.create_training_client_from_state_with_optimizer(resume).result()
        assert [
            train_step(resumed, data),
            logprob_bits(resumed.forward(data, "cross_entropy").result()),
        ] == uninterrupted
        for name in names:
            sc2.create_training_client_from_state(f"tinker://{tc.model_id}/{name}").result()
        latest = resumed.save_state("s4").result().path
        after_s4 = train_step(resumed, data)
        snapshot = resumed.save_weights_for_sampler("snap").result().path
        # A client that outlives this server (released with the next one).
        sampling = tinker.ServiceClient(base_url=second.url, api_key=second.keys["alice"])
        sampler = sampling.create_sampling_client(model_path=snapshot)
        sampled = tokens_of(sampler.sample(PROMPT, 2, SEEDED).result())
        resumed.forward_backward(data, "cross_entropy")  # killed while training
        time.sleep(0.02)
    finally:
        second.kill()

    port = int(second.url.rsplit(":", 1)[1])
    third = SubprocessServer(run_dir, keys=first.keys, kill_at="after_replace:1", port=port)
    try:
        third.clients.append(sampling)
        # The sampling session of the killed server samples its snapshot as before.
        assert tokens_of(sampler.sample(PROMPT, 2, SEEDED).result()) == sampled
        rest = tinker.RestClient(base_url=third.url, api_key=third.keys["alice"])
        runs = rest.list_training_runs().result().training_runs
        assert {r.last_checkpoint.tinker_path for r in runs if r.last_checkpoint} >= {latest}
        again = third.client("alice").create_training_client_from_state_with_optimizer(latest)
        again = again.result()
        assert train_step(again, data) == after_s4
        again.save_state("s5")  # published by the store, killed before the service records it
        third.wait_killed()
    finally:
        third.kill()

    assert len(unrecorded(run_dir)) == 1  # s5, published by the store, never recorded
    fourth = SubprocessServer(run_dir, keys=first.keys)
    try:
        assert unrecorded(run_dir) == set()
        rest = tinker.RestClient(base_url=fourth.url, api_key=fourth.keys["alice"])
        checkpoints = rest.list_checkpoints(again.model_id).result().checkpoints
        assert checkpoints == []  # an unrecorded save is not listed
        sc4 = fourth.client("alice")
        with pytest.raises(tinker.RequestFailedError, match="was not found"):
            sc4.create_training_client_from_state(f"tinker://{again.model_id}/weights/s5").result()
        resumed = sc4.create_training_client_from_state_with_optimizer(latest)
        assert train_step(resumed.result(), data) == after_s4
        assert fourth.terminate() == 0
    finally:
        fourth.kill()
