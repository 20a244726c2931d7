"""Sampling through the SDK on a server in this process: sampler snapshots
(save_weights_for_sampler, save_weights_and_get_sampling_client, create_sampling_session
from a path or the base model, GET samplers/{id}), asample and compute_logprobs.

Greedy samples equal ``PeftModel.generate`` on the snapshot's PEFT export loaded with
plain transformers + peft; a seed repeats exactly; compute_logprobs equals the training
slot's forward log-probabilities at the snapshot; later training never changes what a
snapshot samples; stops, several prompt chunks, tenancy and bad parameters.

The module's own server computes in FP32 (``model.dtype=fp32``, exports in FP32): the
tiny model's greedy choices have near-ties that one BF16 rounding of another summation
order (the slots' batched LoRA product against PEFT's) can flip."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response as decode

from tests.service.helpers import BASE_MODEL, InProcessServer, examples, train_step

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
PROMPTS = ("User: Uppercase word1\nAssistant:", "User: Uppercase word3\nAssistant: W", "User: hi")
GREEDY = types.SamplingParams(max_tokens=10, temperature=0)
SEEDED = types.SamplingParams(max_tokens=10, temperature=1.0, top_k=40, top_p=0.9, seed=1234)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = InProcessServer(tmp_path_factory.mktemp("sample"), "model.dtype=fp32",
                             "export.dtype=fp32")  # fmt: skip
    yield served
    served.close()


@pytest.fixture(scope="module")
def trained(server):
    """Alice's model trained a few steps and a sampler snapshot of it."""
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result()
    tokenizer = tc.get_tokenizer()
    data = examples(tokenizer, 4)
    for _ in range(6):
        train_step(tc, data)
    path = tc.save_weights_for_sampler("snap").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    yield {"sc": sc, "tc": tc, "tok": tokenizer, "path": path, "sampler": sampler, "data": data}
    sc.close("success").result()


def prompt_of(tokenizer, text: str) -> types.ModelInput:
    return types.ModelInput.from_ints(tokenizer.encode(text))


def samples(sampler, prompt, n: int, params) -> list[tuple[list[int], str]]:
    response = sampler.sample(prompt, n, params).result()
    return [(s.tokens, s.stop_reason) for s in response.sequences]


def store_ref(server, path: str) -> str:
    return server.store_ref(path)


def test_save_weights_for_sampler_publishes_a_snapshot_and_a_sampler_names_it(server, trained):
    tc, path = trained["tc"], trained["path"]
    assert path == f"tinker://{tc.model_id}/sampler_weights/snap"
    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert path in listed
    ref = store_ref(server, path)
    assert (server.service.checkpoints.export_dir(ref) / "adapter_config.json").is_file()
    sampler = trained["sampler"]
    info = rest.get_sampler(sampler._sampling_session_id).result()
    assert (info.base_model, info.model_path) == (BASE_MODEL, path)
    with server.http("alice") as http:
        assert http.get(f"/samplers/{info.sampler_id}").json()["model_path"] == path
    with server.http("bob") as http:  # another tenant's sampler: not found
        assert http.get(f"/samplers/{info.sampler_id}").status_code == 404


def test_greedy_samples_equal_peft_generate_on_the_snapshot_export(server, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tok, sampler = trained["tok"], trained["sampler"]
    export = server.service.checkpoints.export_dir(store_ref(server, trained["path"]))
    base = AutoModelForCausalLM.from_pretrained(export.parent.parent / "hf_base",
                                                dtype=torch.float32)  # fmt: skip
    reference = PeftModel.from_pretrained(base, str(export)).eval()
    for text in PROMPTS:
        ids = tok.encode(text)
        (tokens, reason), again = samples(sampler, prompt_of(tok, text), 2, GREEDY)
        assert again == (tokens, reason)  # greedy: every sample the same
        with torch.no_grad():
            out = reference.generate(input_ids=torch.tensor([ids]),
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=10, do_sample=False, temperature=None,
                                     top_p=None, top_k=None, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()  # fmt: skip
        assert tokens == out, text
        assert reason == ("stop" if out[-1] == tok.eos_token_id and len(out) < 10 else "length")


def test_seeded_sampling_repeats_and_a_snapshot_never_changes_with_training(server, trained):
    tok, sampler, tc = trained["tok"], trained["sampler"], trained["tc"]
    prompt = prompt_of(tok, PROMPTS[0])
    first = sampler.sample(prompt, 4, SEEDED).result()
    seeded = [(s.tokens, s.logprobs) for s in first.sequences]
    assert len({tuple(t) for t, _ in seeded}) > 1  # the samples of one request differ
    assert [
        (s.tokens, s.logprobs) for s in sampler.sample(prompt, 4, SEEDED).result().sequences
    ] == seeded
    other = types.SamplingParams(**{**SEEDED.model_dump(), "seed": 99})
    assert [s.tokens for s in sampler.sample(prompt, 4, other).result().sequences] != [
        t for t, _ in seeded
    ]
    for (tokens, logprobs), _ in zip(seeded, range(4), strict=False):
        assert len(logprobs) == len(tokens) and all(math.isfinite(x) and x <= 0 for x in logprobs)
    greedy = samples(sampler, prompt, 1, GREEDY)
    lps = sampler.compute_logprobs(prompt).result()
    data = trained["data"]
    for _ in range(3):  # train on: the snapshot's samples stay the same
        train_step(tc, data, learning_rate=1e-2)
    assert [
        (s.tokens, s.logprobs) for s in sampler.sample(prompt, 4, SEEDED).result().sequences
    ] == seeded
    assert samples(sampler, prompt, 1, GREEDY) == greedy
    assert sampler.compute_logprobs(prompt).result() == lps
    newer = (
        tc.save_weights_and_get_sampling_client().result()
    )  # the unnamed snapshot, after training
    assert newer.compute_logprobs(prompt).result() != lps


def test_compute_logprobs_equals_the_training_forward_at_the_snapshot(server):
    sc = server.client("bob")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=8).result()
    tok = tc.get_tokenizer()
    train_step(tc, examples(tok, 3))
    sampler = tc.save_weights_and_get_sampling_client().result()
    for text in PROMPTS:
        ids = tok.encode(text)
        chunked = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=ids[:3]),
                                           types.EncodedTextChunk(tokens=ids[3:])])  # fmt: skip
        got = sampler.compute_logprobs(chunked).result()
        assert got[0] is None and len(got) == len(ids)
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs={
            "target_tokens": np.array([*ids[1:], 0]), "weights": np.ones(len(ids), np.float32)})  # fmt: skip
        forward = tc.forward([datum], "cross_entropy").result()
        expected = forward.loss_fn_outputs[0]["logprobs"].to_numpy()[:-1]
        np.testing.assert_array_equal(np.array(got[1:], np.float32), expected)
    sc.close("success").result()


def test_stop_tokens_stop_strings_chunks_and_the_base_model(server, trained):
    tok, sampler, sc = trained["tok"], trained["sampler"], trained["sc"]
    text = PROMPTS[1]
    ids = tok.encode(text)
    [(tokens, _)] = samples(sampler, prompt_of(tok, text), 1, GREEDY)
    chunked = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=ids[:2]),
                                       types.EncodedTextChunk(tokens=ids[2:5]),
                                       types.EncodedTextChunk(tokens=ids[5:])])  # fmt: skip
    assert samples(sampler, chunked, 1, GREEDY) == samples(sampler, prompt_of(tok, text), 1, GREEDY)
    stop_at = tokens[3]
    by_id = types.SamplingParams(max_tokens=10, temperature=0, stop=[stop_at])
    [(stopped, reason)] = samples(sampler, prompt_of(tok, text), 1, by_id)
    assert reason == "stop" and stopped == tokens[: tokens.index(stop_at) + 1]
    piece = tok.decode(tokens[:3])[-1:]  # a string the greedy text contains early
    by_text = types.SamplingParams(max_tokens=10, temperature=0, stop=[piece])
    [(stopped, reason)] = samples(sampler, prompt_of(tok, text), 1, by_text)
    assert reason == "stop" and piece in tok.decode(stopped) and len(stopped) <= 3
    none = types.SamplingParams(max_tokens=10, temperature=0, stop=[])
    assert samples(sampler, prompt_of(tok, text), 1, none)[0][1] == "length"
    base = sc.create_sampling_client(base_model=BASE_MODEL).result()
    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    assert rest.get_sampler(base._sampling_session_id).result().model_path is None
    [(base_tokens, _)] = samples(base, prompt_of(tok, text), 1, GREEDY)
    assert base_tokens != tokens  # the base alone, not the adapter


def run_to_end(service, ops) -> list:
    """The worker's sampling batch of ``ops``, every slice of it."""
    batch = service.run_batch(ops)
    while not batch.advance():
        pass
    return batch.results()


def test_concurrent_requests_of_two_tenants_batch_and_sample_as_alone(server, trained):
    tok, sampler = trained["tok"], trained["sampler"]
    sc = server.client("bob")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2, seed=3).result()
    train_step(tc, examples(tok, 2), learning_rate=2e-2)
    bobs = tc.save_weights_and_get_sampling_client().result()
    prompts = [prompt_of(tok, t) for t in PROMPTS]
    alone = [(samples(s, p, 2, SEEDED), samples(s, p, 1, GREEDY))
             for s in (sampler, bobs) for p in prompts]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [(pool.submit(samples, s, p, 2, SEEDED), pool.submit(samples, s, p, 1, GREEDY))
                for s in (sampler, bobs) for p in prompts]  # fmt: skip
        together = [(a.result(), b.result()) for a, b in jobs]
    assert together == alone
    # the same requests as one batch of rows on the worker's path, deterministically
    service = server.service
    tenants = {name: server.tenant_id(name) for name in ("alice", "bob")}
    bodies = []
    for tenant, s in (("alice", sampler), ("bob", bobs)):
        for p in prompts:
            for params, n in ((SEEDED, 2), (GREEDY, 1)):
                bodies.append((tenants[tenant], {
                    "sampling_session_id": s._sampling_session_id, "num_samples": n,
                    "prompt": p.model_dump(mode="json"), "sampling_params": params.model_dump()}))  # fmt: skip
    ops = [service.samplers.prepare(t, types.SampleRequest.model_validate(body))[0]
           for t, body in bodies]  # fmt: skip
    batched = run_to_end(service, ops)
    assert len({op.batch.request.store_ref for op in ops}) == 2
    flat = [v for pair in alone for v in pair]
    got = [[(q.tokens, q.stop_reason) for q in decode(r).sequences] for r in batched]
    assert got == flat  # the same tokens; log-probs to float rounding (padded rows)
    for op, result in zip(ops, batched, strict=True):
        for a, b in zip(decode(result).sequences, decode(run_to_end(service, [op])[0]).sequences,
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    sc.close("success").result()


def test_tenancy_and_bad_sampling_parameters(server, trained):
    tok = trained["tok"]
    bob = server.client("bob")
    with pytest.raises(tinker.APIStatusError) as caught:  # alice's path: not found for bob
        bob.create_sampling_client(model_path=trained["path"]).result()
    assert caught.value.status_code == 404 and "not found" in str(caught.value.body)
    with pytest.raises(tinker.APIStatusError) as caught:
        bob.create_sampling_client(model_path=trained["path"].replace("snap", "nothing")).result()
    assert caught.value.status_code == 404
    bob.close("success").result()
    sampler, prompt = trained["sampler"], prompt_of(tok, PROMPTS[0])
    cases = [
        (types.SamplingParams(max_tokens=1000), "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=4, temperature=-1), "sampling_params.temperature"),
        (types.SamplingParams(max_tokens=4, top_p=0), "sampling_params.top_p"),
        (types.SamplingParams(max_tokens=4, stop=[10**6]), "sampling_params.stop"),
        (types.SamplingParams(max_tokens=4, seed=-1), "sampling_params.seed"),
    ]
    for params, word in cases:
        with pytest.raises(tinker.APIStatusError) as caught:
            sampler.sample(prompt, 1, params).result()
        assert 400 <= caught.value.status_code < 500 and word in str(caught.value.body), word
    with pytest.raises(tinker.APIStatusError, match="num_samples"):
        sampler.sample(prompt, 1000, GREEDY).result()
    body = {"sampling_session_id": sampler._sampling_session_id, "num_samples": 1,
            "prompt": prompt.model_dump(mode="json"), "sampling_params": GREEDY.model_dump()}  # fmt: skip
    with server.http("bob") as http:  # alice's sampler: not found for bob
        refused = http.post("/asample", json=body)
        assert refused.status_code == 404 and "not found" in refused.json()["detail"]
    with server.http("alice") as http:
        assert "sample_sequence_ids" in http.post("/asample", json=body).json()
    sampler.sample(prompt, 1, GREEDY).result()  # its metrics line is written before its result
    lines = [json.loads(x) for x in (server.run_dir / "metrics.jsonl").read_text().splitlines()]
    sampled = [x for x in lines if x["op"] == "sample"]
    assert sampled and all(x["tokens"] >= 1 and x["rows_in_batch"] >= 1 for x in sampled)


def test_training_models_take_snapshot_slots_and_snapshots_come_back(server, trained):
    tok, sampler = trained["tok"], trained["sampler"]
    prompt = prompt_of(tok, PROMPTS[0])
    greedy = samples(sampler, prompt, 1, GREEDY)
    assert server.service.slots.snapshots()  # the snapshot is cached in a slot
    bob = server.client("bob")
    free = server.trainer.num_slots - server.service.slots.training()
    models = [bob.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
              for _ in range(free)]  # fmt: skip
    assert len(models) == free and not server.service.slots.snapshots()
    with pytest.raises(tinker.RequestFailedError, match="lora.num_slots"):
        sampler.sample(prompt, 1, GREEDY).result()
    bob.close("success").result()
    assert samples(sampler, prompt, 1, GREEDY) == greedy  # reloaded: the same snapshot


def test_deleting_a_sampler_checkpoint_removes_its_entry_and_export(server, trained):
    tc = trained["tc"]
    path = tc.save_weights_for_sampler("gone").result().path
    ref = store_ref(server, path)
    export = server.service.checkpoints.export_dir(ref)
    entry = server.trainer.store.root / ref
    assert export.is_dir() and entry.is_dir()
    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    rest.delete_checkpoint_from_tinker_path(path).result()
    deadline = time.monotonic() + 10
    while (export.exists() or entry.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)  # the deletion runs on the worker
    assert not export.exists() and not entry.exists()
    with pytest.raises(tinker.APIStatusError) as caught:
        trained["sc"].create_sampling_client(model_path=path).result()
    assert caught.value.status_code == 404


def next_token_logits(server, trained, text: str) -> torch.Tensor:
    """The snapshot's next-token logits after ``text``, from its PEFT export (FP32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    export = server.service.checkpoints.export_dir(store_ref(server, trained["path"]))
    base = AutoModelForCausalLM.from_pretrained(export.parent.parent / "hf_base",
                                                dtype=torch.float32)  # fmt: skip
    reference = PeftModel.from_pretrained(base, str(export)).eval()
    with torch.no_grad():
        return reference(input_ids=torch.tensor([trained["tok"].encode(text)])).logits[0, -1]


def test_top_k_samples_only_among_the_k_likeliest_and_can_pick_each(server, trained):
    tok, sampler = trained["tok"], trained["sampler"]
    text = PROMPTS[2]
    ranked = next_token_logits(server, trained, text).sort(descending=True).values
    gaps = {k: float(ranked[k - 1] - ranked[k]) for k in range(2, 9)}
    k = max(gaps, key=gaps.get)  # a clear boundary: no near-tie decides the set
    assert gaps[k] > 1e-3
    expected = set(next_token_logits(server, trained, text).topk(k).indices.tolist())
    flat = types.SamplingParams(max_tokens=1, temperature=100.0, top_k=k, seed=3, stop=[])
    drawn = [s[0][0] for s in samples(sampler, prompt_of(tok, text), 64, flat)]
    assert set(drawn) == expected  # only the k likeliest, and each of them
    free = types.SamplingParams(max_tokens=1, temperature=100.0, seed=3, stop=[])
    assert not set(s[0][0] for s in samples(sampler, prompt_of(tok, text), 64, free)) <= expected
    one = types.SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5, stop=[])
    greedy = types.SamplingParams(max_tokens=8, temperature=0, stop=[])
    for text in PROMPTS:
        assert [t for t, _ in samples(sampler, prompt_of(tok, text), 3, one)] == [
            t for t, _ in samples(sampler, prompt_of(tok, text), 3, greedy)
        ]


def download(rest: tinker.RestClient, path: str, into: Path) -> dict[str, str]:
    """The files of external-weights path ``path`` through their signed URLs (no key)."""
    import urllib.request

    answer = rest.get_external_weights_urls(path).result()
    assert set(answer.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    into.mkdir(parents=True, exist_ok=True)
    for name, url in answer.urls.items():
        with urllib.request.urlopen(url, timeout=30) as response:
            (into / name).write_bytes(response.read())
    return answer.urls


def test_a_tenant_downloads_its_sampler_checkpoint_and_plain_peft_loads_it(
    server, trained, tmp_path
):
    """``RestClient.get_external_weights_urls`` on a sampler checkpoint (its path with
    ``external_weights``): signed links to its PEFT adapter, which plain ``peft`` loads on
    the base and samples like the server."""
    import urllib.error
    import urllib.request

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    external = trained["path"].replace("/sampler_weights/", "/external_weights/")
    urls = download(rest, external, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_MODEL  # not the server's path
    export = server.service.checkpoints.export_dir(store_ref(server, trained["path"]))
    weights = "adapter_model.safetensors"
    assert (tmp_path / weights).read_bytes() == (export / weights).read_bytes()
    base = AutoModelForCausalLM.from_pretrained(export.parent.parent / "hf_base",
                                                dtype=torch.float32)  # fmt: skip
    adapter = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    tok = trained["tok"]
    ids = tok.encode(PROMPTS[0])
    with torch.no_grad():
        out = adapter.generate(input_ids=torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                               temperature=None, top_p=None, top_k=None,
                               pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()  # fmt: skip
    params = types.SamplingParams(max_tokens=6, temperature=0, stop=[])
    assert samples(trained["sampler"], prompt_of(tok, PROMPTS[0]), 1, params)[0][0] == out
    forged = urls[weights].replace("/downloads/", "/downloads/x")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(forged, timeout=30)
    assert refused.value.code == 401
    bob = tinker.RestClient(base_url=server.url, api_key=server.keys["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob.get_external_weights_urls(external).result()
    with httpx.Client(
        base_url=f"{server.url}/api/v1", headers={"X-API-Key": server.keys["alice"]}
    ) as http:
        training = trained["tc"].save_state("not_downloadable").result().path
        run, checkpoint = training.removeprefix("tinker://").split("/", 1)
        refused = http.get(f"/training_runs/{run}/checkpoints/{checkpoint}/external_weights_urls")
        assert refused.status_code == 400 and "checkpoint_id" in refused.json()["detail"]


def test_save_weights_external_exports_the_adapter_to_download(server, trained, tmp_path):
    """The SDK's own way home: ``save_weights_external`` then ``get_external_weights_urls``
    (a PEFT export, listed as an ``external`` checkpoint, deletable, never loaded)."""
    tc = trained["tc"]
    saved = tc.save_weights_external("home").result().path
    assert saved == f"tinker://{tc.model_id}/external_weights/home"
    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    download(rest, saved, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_MODEL and config["r"] == 8
    listed = {
        c.tinker_path: c.checkpoint_type
        for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    }
    assert listed[saved] == "external"
    with pytest.raises(tinker.APIStatusError) as refused:
        trained["sc"].create_training_client_from_state(saved).result()
    assert refused.value.status_code == 400 and "path must be" in str(refused.value.body)
    rest.delete_checkpoint_from_tinker_path(saved).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_external_weights_urls(saved).result()


def test_deleting_a_checkpoint_a_sampler_samples_ends_that_sampler_clearly(server, trained):
    """The rule: a delete is never refused; the samplers of the deleted checkpoint end at
    once (their next request answers 404 naming the checkpoint) and its slot is freed."""
    tc, sc, tok = trained["tc"], trained["sc"], trained["tok"]
    path = tc.save_weights_for_sampler("pinned").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    prompt = prompt_of(tok, PROMPTS[0])
    samples(sampler, prompt, 1, GREEDY)
    ref = store_ref(server, path)
    assert ref in server.service.slots.snapshots()
    rest = tinker.RestClient(base_url=server.url, api_key=server.keys["alice"])
    rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.APIStatusError) as ended:
        sampler.sample(prompt, 1, GREEDY).result()
    assert ended.value.status_code == 404
    assert f"samples {path}, which was deleted" in ended.value.body["detail"]
    deadline = time.monotonic() + 10
    while ref in server.service.slots.snapshots() and time.monotonic() < deadline:
        time.sleep(0.05)  # the store entry and its slot go on the worker
    assert ref not in server.service.slots.snapshots()
    assert samples(trained["sampler"], prompt, 1, GREEDY)  # another checkpoint's sampler goes on
