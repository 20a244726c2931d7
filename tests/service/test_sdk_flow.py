"""The pinned ``tinker`` SDK against a real ``python -m tasks.serve`` process: the whole
flow of a training script (and sampling from its snapshot), keys refused, checkpoints listed and deleted, SIGTERM fails the
request still waiting (a server error its client can read) and exits 0."""

from __future__ import annotations

import signal

import httpx
import pytest
import tinker

from tests.service.helpers import BASE_MODEL, SubprocessServer, datum, examples, train_step
from tests.service.test_bad_inputs import PROTO, fwd_body

pytestmark = [pytest.mark.starts_processes, pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_the_sdk_trains_a_lora_through_a_server_process(tmp_path):
    srv = SubprocessServer(tmp_path / "run")
    try:
        health = httpx.get(f"{srv.url}/api/v1/healthz", timeout=10).json()  # no key needed
        assert health == {"status": "ok", "slots_used": 0, "slots_free": 4, "ranks": 1}
        with httpx.Client(base_url=f"{srv.url}/api/v1", timeout=10) as anonymous:
            assert anonymous.get("/get_server_capabilities").status_code == 401
            assert anonymous.post("/create_session", json={}).status_code == 401
            wrong = {"X-API-Key": "tml-not-a-key-of-this-server"}
            response = anonymous.post("/client/config", json={"sdk_version": "0"}, headers=wrong)
            assert response.status_code == 401 and "not known" in response.json()["detail"]

        sc = srv.client("alice")
        caps = sc.get_server_capabilities()
        assert [m.model_name for m in caps.supported_models] == [BASE_MODEL]
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        tokenizer = tc.get_tokenizer()  # a local directory: loads offline
        assert tokenizer.encode("User: hi") and tc.get_info().lora_rank == 4
        data = examples(tokenizer, 4)
        losses = [train_step(tc, data) for _ in range(8)]
        assert losses[-1] < 0.8 * losses[0], losses
        assert httpx.get(f"{srv.url}/api/v1/healthz", timeout=10).json()["slots_used"] == 1

        sampler = tc.save_weights_and_get_sampling_client().result()  # protobuf over HTTP
        prompt = tinker.types.ModelInput.from_ints(tokenizer.encode("User: Uppercase word1"))
        params = tinker.types.SamplingParams(max_tokens=6, temperature=0, stop=[])
        (sequence,) = sampler.sample(prompt, 1, params).result().sequences
        assert len(sequence.tokens) == 6 and sequence.stop_reason == "length"
        assert sampler.compute_logprobs(prompt).result()[0] is None
        saved = tc.save_state("after8").result().path
        assert saved == f"tinker://{tc.model_id}/weights/after8"
        rest = tinker.RestClient(base_url=srv.url, api_key=srv.keys["alice"])
        (run,) = rest.list_training_runs().result().training_runs
        assert run.training_run_id == tc.model_id and run.model_owner == "alice"
        assert run.last_checkpoint.tinker_path == saved
        listed = rest.list_checkpoints(tc.model_id).result().checkpoints
        ephemeral = f"tinker://{tc.model_id}/sampler_weights/ephemeral_000017"
        assert [c.tinker_path for c in listed] == [ephemeral, saved] and listed[1].size_bytes > 0
        for path in (saved, ephemeral):
            rest.delete_checkpoint_from_tinker_path(path).result()
        assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
        with pytest.raises(tinker.RequestFailedError, match="not found"):
            tc.load_state(saved).result()
        sc.close("success").result()
        assert httpx.get(f"{srv.url}/api/v1/healthz", timeout=10).json()["slots_used"] == 0
        waiting = srv.client("bob").create_lora_training_client(base_model=BASE_MODEL, rank=2)
        waiting = waiting.result()
        with srv.http("bob") as http:  # seq_id 2 before 1: it waits when SIGTERM comes
            body = fwd_body(waiting.model_id, 2, [datum([1, 2, 3])])
            future = http.post("/forward_backward", content=body, headers=PROTO).json()
            srv.proc.send_signal(signal.SIGTERM)
            answer = {"type": "try_again"}
            for _ in range(50):  # the drain fails it; its answer stays retrievable a while
                answer = http.post("/retrieve_future", json={"request_id": future["request_id"]})
                answer = answer.json()
                if answer.get("type") != "try_again":
                    break
            assert answer["category"] == "server" and "shut down" in answer["error"]
        assert srv.terminate() == 0
    finally:
        srv.kill()
    log = (tmp_path / "run" / "server.log").read_text()
    assert "endpoint=POST /api/v1/forward_backward" in log and "status=200" in log
    assert srv.keys["alice"] not in log and "stopped" in log
