"""The service launched by ``torchrun`` on 2 gloo ranks (``parallel=fsdp``), driven by the
real SDK: training, an exact save -> load with optimizer, tenant isolation and sampling
give what one process gives (bitwise where the computation is the same, within float
tolerance where the ranks' partial gradient sums change the order), and a killed rank
fails the request in flight with a ``server`` error at once; the job then answers every
trainer request with that error and ``healthz`` names it, never a hang."""

from __future__ import annotations

import os
import signal
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.service.helpers import (
    BASE_MODEL,
    Served,
    SubprocessServer,
    TorchrunServer,
    examples,
    train_step,
)
from tests.service.test_restart import logprob_bits, tokens_of

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPT = types.ModelInput.from_ints([1, 2, 3, 4, 5])
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
SLOTS = "lora.num_slots=6"


def flow(served: Served) -> dict:
    """Train, save, load two ways, isolate, sample: what a client sees."""
    sc = served.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    data = examples(tc.get_tokenizer(), 5)  # 5 rows: 2 on rank 0, 3 on rank 1
    losses = [train_step(tc, data) for _ in range(3)]
    state = tc.save_state("k3").result().path
    exact = sc.create_training_client_from_state_with_optimizer(state).result()
    weights_only = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    weights_only.load_state(state).result()
    after = {
        name: [
            [train_step(c, data) for _ in range(2)],
            logprob_bits(c.forward(data, "cross_entropy").result()),
        ]  # fmt: skip
        for name, c in (("original", tc), ("exact", exact), ("weights_only", weights_only))
    }
    one_row = logprob_bits(tc.forward(data[:1], "cross_entropy").result())  # rank 1 pads

    # Tenant bob trains like alice did; alice's refused loads come between his steps.
    bob = served.client("bob")
    btc = bob.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    bobs_path = btc.save_weights_for_sampler("b0").result().path
    bob_losses, refusals = [], []
    for _ in range(3):
        with pytest.raises(tinker.RequestFailedError, match="not found") as refused:
            sc.create_training_client_from_state(bobs_path).result()
        refusals.append(refused.value.category)
        bob_losses.append(train_step(btc, data))

    sampler = tc.save_weights_and_get_sampling_client("snap")
    base = sc.create_sampling_client(base_model=BASE_MODEL)
    return {
        "losses": losses, "after": after, "one_row": one_row, "bob": bob_losses,
        "refusals": refusals,
        "greedy": tokens_of(sampler.sample(PROMPT, 3, GREEDY).result()),
        "seeded": [tokens_of(sampler.sample(PROMPT, 3, SEEDED).result()) for _ in range(2)],
        "base_greedy": tokens_of(base.sample(PROMPT, 3, GREEDY).result()),
    }  # fmt: skip


def test_two_ranks_serve_what_one_process_serves(tmp_path):
    single = SubprocessServer(tmp_path / "one", SLOTS)
    try:
        one = flow(single)
    finally:
        single.terminate()
    job = TorchrunServer(tmp_path / "two", SLOTS)
    try:
        two = flow(job)
        with job.http(None) as http:
            assert http.get("/healthz").json()["ranks"] == 2
    finally:
        codes = job.terminate()
    assert codes == [0], f"torchrun exited with {codes}; see {tmp_path / 'two'}"

    for run in (one, two):
        # Exact continuation on each: the loaded-with-optimizer slot trains like the
        # original bit for bit; loading weights only does not (the negative control).
        assert run["after"]["exact"] == run["after"]["original"]
        assert run["after"]["weights_only"][0] != run["after"]["original"][0]
        # Isolation: bob trains exactly as alice did, refused loads in between.
        assert run["refusals"] == [types.RequestErrorCategory.User] * 3
        assert run["bob"] == run["losses"]
        # Sampling: seeded repeats, greedy rows agree across the ranks that ran them.
        assert run["seeded"][0] == run["seeded"][1]
        assert all(row == run["greedy"][0] for row in run["greedy"])
    # Across rank counts: the first step is the same computation (bitwise); after it the
    # gradient of a batch is the sum of the ranks' partial sums, another float order
    # (measured: losses 1.006e-4 relative apart, a forward of the trained BF16 model 1.7e-3;
    # docs/service.md states 3e-4 and 5e-3).
    assert two["losses"][0] == one["losses"][0]
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=3e-4)
    np.testing.assert_allclose(two["bob"], one["bob"], rtol=3e-4)
    assert two["base_greedy"] == one["base_greedy"]
    lp = [np.frombuffer(b, np.float32) for b in (one["one_row"][0], two["one_row"][0])]
    np.testing.assert_allclose(lp[1], lp[0], rtol=5e-3, atol=1e-3)


def test_a_killed_rank_fails_the_request_in_flight_with_a_server_error(tmp_path):
    job = TorchrunServer(tmp_path / "run", nodes=2)
    try:
        sc = job.client("alice")
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        data = examples(tc.get_tokenizer(), 3)
        train_step(tc, data)
        os.kill(job.rank_pid(1), signal.SIGKILL)
        time.sleep(0.5)
        began = time.monotonic()
        for call in (lambda: tc.forward_backward(data, "cross_entropy").result(),
                     lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()):  # fmt: skip
            with pytest.raises(tinker.RequestFailedError) as failed:
                call()
            assert failed.value.category == types.RequestErrorCategory.Server
            assert "a rank of this torchrun job was lost" in str(failed.value)
        assert time.monotonic() - began < 30
        health = httpx.get(f"{job.url}/api/v1/healthz", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "lost_rank"
        with job.http("alice") as http:  # the rest of the API still answers
            assert http.post("/get_info", json={"model_id": tc.model_id}).status_code == 200
    finally:
        job.terminate(agents_s=1)  # rank 0 stops (its agent then waits for node 1's: minutes)
