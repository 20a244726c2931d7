"""With ``serve.batch_tenants``, a ``forward`` request batched beside another model's
``forward_backward`` runs in the same slot batch and trains nothing of its own model:
its gradients (and the count its next step applies) stay exactly as they were, and the
other model's gradient is that of its lone run (FP32 base: within float rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.service.helpers import BASE_MODEL, InProcessServer, examples
from tests.service.test_isolation import scaled_differences
from veoptim.service.wire import ForwardBackwardRequest, decode_forward_backward

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
RTOL = 1e-5


def request(model_id: str, data: list[types.Datum], forward_only: bool) -> ForwardBackwardRequest:
    sdk = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1,
    )  # fmt: skip
    msg = forward_backward_request_to_proto(sdk)
    msg.forward_only = forward_only
    return decode_forward_backward(msg.SerializeToString())


def gradients(srv: InProcessServer, model_id: str) -> dict[str, torch.Tensor | None]:
    slot = srv.slot_of(model_id)
    return {n: None if p.grad is None else p.grad.detach().clone()
            for n, p in srv.trainer.slots[slot].params.named}  # fmt: skip


def pending(srv: InProcessServer, model_id: str) -> float:
    return srv.trainer.slots[srv.slot_of(model_id)].optimizer.pending_tokens


def logprobs(result: bytes) -> list[np.ndarray]:
    out = deserialize_forward_backward_output(result)
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_a_forward_beside_a_forward_backward_trains_only_the_latter(tmp_path):
    srv = InProcessServer(tmp_path / "serve", "model.dtype=fp32", "serve.batch_tenants=true")
    try:
        alice, bob = srv.client("alice"), srv.client("bob")
        a = alice.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        b, twin = (bob.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
                   for _ in range(2))  # fmt: skip
        tok = a.get_tokenizer()
        a.forward_backward(examples(tok, 2), "cross_entropy").result()  # gradients to keep
        kept, kept_pending = gradients(srv, a.model_id), pending(srv, a.model_id)
        assert all(g is not None for g in kept.values())
        backend, models = srv.service.backend, srv.service.engine.models
        a_data, b_data = examples(tok, 2, start=10), examples(tok, 3, start=20)
        forward = backend.prepare_forward_backward(
            models[a.model_id], request(a.model_id, a_data, True)
        )
        trains = backend.prepare_forward_backward(
            models[b.model_id], request(b.model_id, b_data, False)
        )
        assert forward.batch.joins(trains.batch) and trains.batch.joins(forward.batch)
        together = backend.forward_backward([forward, trains])  # one slot batch
        (alone,) = backend.forward_backward(
            [
                backend.prepare_forward_backward(
                    models[twin.model_id], request(twin.model_id, b_data, False)
                )
            ]
        )
        after = gradients(srv, a.model_id)
        assert all(torch.equal(kept[n], after[n]) for n in kept)  # bit for bit
        assert pending(srv, a.model_id) == kept_pending
        assert (
            scaled_differences(gradients(srv, twin.model_id), gradients(srv, b.model_id), RTOL)
            == []
        )
        for got, want in zip(logprobs(together[1]), logprobs(alone), strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
        (a_alone,) = backend.forward_backward(
            [
                backend.prepare_forward_backward(
                    models[a.model_id], request(a.model_id, a_data, True)
                )
            ]
        )
        for got, want in zip(logprobs(together[0]), logprobs(a_alone), strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
    finally:
        srv.close()
