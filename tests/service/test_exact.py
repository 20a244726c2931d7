"""Through the SDK, on a server in this process (its trainer's slot state is readable):
the log-probabilities it returns are those of a direct SlotTrainer pass, bit for bit; and
save_state -> create_training_client_from_state_with_optimizer continues exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tests.service.helpers import BASE_MODEL, differences, examples, train_step
from veoptim.slots import SLOT_IDS
from veoptim.slots.tokens import forward_tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
ADAM = {"learning_rate": 5e-3, "beta2": 0.99, "weight_decay": 0.01, "grad_clip_norm": 1.0}


def direct_batch(data: list[types.Datum], slot: int) -> dict[str, torch.Tensor]:
    """The datums as one slot batch, built here from the SDK objects (right-padded)."""
    rows = [d.model_input.to_ints() for d in data]
    length = max(len(r) for r in rows)
    batch = {k: torch.zeros(len(rows), length, dtype=torch.long)
             for k in ("input_ids", "attention_mask", "target_tokens")}  # fmt: skip
    for i, (tokens, d) in enumerate(zip(rows, data, strict=True)):
        batch["input_ids"][i, : len(tokens)] = torch.tensor(tokens)
        batch["attention_mask"][i, : len(tokens)] = 1
        batch["target_tokens"][i, : len(tokens)] = d.loss_fn_inputs["target_tokens"].to_torch()
    batch[SLOT_IDS] = torch.full((len(rows),), slot)
    return batch


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def test_returned_logprobs_equal_a_direct_slot_trainer_pass_bitwise(server):
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
    data = examples(tc.get_tokenizer(), 3)
    for _ in range(3):
        train_step(tc, data, **ADAM)
    slot = server.slot_of(tc.model_id)
    direct = forward_tokens(server.trainer, direct_batch(data, slot)).logprobs
    forward = tc.forward(data, "cross_entropy").result()
    backward = tc.forward_backward(data, "cross_entropy").result()
    for i, d in enumerate(data):
        n = d.model_input.length
        expected = bits(direct[i, :n].numpy())
        assert np.array_equal(bits(forward.loss_fn_outputs[i]["logprobs"].to_numpy()), expected)
        assert np.array_equal(bits(backward.loss_fn_outputs[i]["logprobs"].to_numpy()), expected)
    expected_loss = -sum(float(direct[i, : d.model_input.length].sum()) for i, d in enumerate(data))
    assert backward.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-6)
    sc.close("success").result()


def test_save_state_and_load_with_optimizer_continue_exactly(server):
    sc = server.client("alice")
    a = sc.create_lora_training_client(base_model=BASE_MODEL, rank=6, seed=11).result()
    data = examples(a.get_tokenizer(), 4)
    for k in range(3):
        train_step(a, data[k % 2 :], **ADAM)
    path = a.save_state("k3").result().path
    other = server.client("alice")  # a new session, like a resumed script
    b = other.create_training_client_from_state_with_optimizer(path).result()
    control = other.create_training_client_from_state(path).result()  # no optimizer state

    def state(tc):
        return server.trainer.slot_state(server.slot_of(tc.model_id))

    assert differences(state(a), state(b)) == []
    assert any(k.startswith(".exp_avg") for k in differences(state(a), state(control)))
    losses = [train_step(tc, data[1:], **ADAM) for tc in (a, b, control)]
    assert losses[0] == losses[1]
    assert differences(state(a), state(b)) == []
    after = differences(state(a), state(control))
    assert any(k.startswith(".master_weight") for k in after) and ".steps" in after
    sc.close("success").result()
    other.close("success").result()


def test_a_datum_in_several_chunks_gives_the_logprobs_and_loss_of_one_chunk(server):
    """The server reads every ``encoded_text`` chunk of a datum's input, in order."""
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=13).result()
    (whole,) = examples(tc.get_tokenizer(), 1)
    ids = whole.model_input.to_ints()
    cuts = [0, 2, 3, len(ids) - 4, len(ids)]
    chunked = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=ids[a:b])
                                             for a, b in zip(cuts, cuts[1:], strict=False)]),
        loss_fn_inputs=whole.loss_fn_inputs,
    )  # fmt: skip
    assert chunked.model_input.to_ints() == ids and len(chunked.model_input.chunks) == 4
    for call in (tc.forward, tc.forward_backward):
        one, several = (call([d], "cross_entropy").result() for d in (whole, chunked))
        assert np.array_equal(bits(several.loss_fn_outputs[0]["logprobs"].to_numpy()),
                              bits(one.loss_fn_outputs[0]["logprobs"].to_numpy()))  # fmt: skip
        assert several.metrics["loss:sum"] == one.metrics["loss:sum"]
    sc.close("success").result()
