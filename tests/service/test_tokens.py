"""``forward_tokens`` (the service's pass) against ``SlotTrainer.forward_backward`` (the
slots' own next-token loss): the same rows give the same loss sum and the same
gradients, so the service's log-probabilities and updates are the trainer's."""

from __future__ import annotations

import pytest
import torch

from tests.service.helpers import BASE_MODEL
from veoptim.data.fields import IGNORE_INDEX
from veoptim.slots import SLOT_IDS
from veoptim.slots.tokens import forward_tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def grads(trainer, slot: int) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in trainer.slots[slot].params.named}


def test_forward_tokens_is_the_slot_trainers_next_token_loss(server):
    sc = server.client("alice")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=4).result()
    trainer, slot = server.trainer, server.slot_of(tc.model_id)
    ids = torch.tensor([[3, 17, 40, 41, 99, 7, 12, 5], [8, 9, 10, 11, 12, 13, 0, 0]])
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    slots = torch.full((2,), slot)
    with trainer._lock:
        (loss,) = trainer.forward_backward(
            {"input_ids": ids, "attention_mask": mask, "labels": labels, SLOT_IDS: slots}
        ).values()
        reference = grads(trainer, slot)
        trainer.slots[slot].optimizer.zero_grad()
        weights = (labels[:, 1:] != IGNORE_INDEX).float()
        batch = {"input_ids": ids[:, :-1], "attention_mask": mask[:, :-1],
                 "target_tokens": ids[:, 1:], "weights": weights, SLOT_IDS: slots}  # fmt: skip
        out = forward_tokens(
            trainer, batch, lambda lp, b: -(lp * b["weights"]).sum(1), backward=True
        )
        mine = grads(trainer, slot)
        trainer.slots[slot].optimizer.zero_grad()
    assert float(out.row_losses.sum()) == pytest.approx(loss.loss_sum, rel=1e-5)
    assert float(-(out.logprobs * weights).sum()) == pytest.approx(loss.loss_sum, rel=1e-5)
    for name, g in reference.items():
        torch.testing.assert_close(mine[name].float(), g.float(), rtol=1e-2, atol=1e-6, msg=name)
    sc.close("success").result()
