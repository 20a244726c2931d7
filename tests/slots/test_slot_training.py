"""Slots train independently: exact continuation through a save and a load into another
slot, steps and loads that touch no other slot, rows routed to their own slot only."""

from __future__ import annotations

import pytest
import torch

from tests.slots.helpers import (
    all_states,
    assert_unchanged,
    batch,
    build,
    differences,
    train,
)
from veoptim.errors import DataError, SlotError
from veoptim.lora.layer import LoRALinear

K = 3


@pytest.fixture
def trained(tmp_path):
    """Slots 0-2 after K mixed steps; slot 0 saved as 'alice'."""
    trainer = build(tmp_path)
    for slot in range(3):
        trainer.create_slot(slot)
    train(trainer, K, [0, 1, 2])
    trainer.save_slot(0, "alice")
    return trainer


def step_alone(trainer, slot: int, rows: list[int]) -> None:
    trainer.forward_backward(batch(rows, [slot] * len(rows)))
    trainer.optim_step(slot)


def masters_differ_from_weights(state: dict) -> bool:
    """Some FP32 master holds bits its BF16 weight lost (so a re-derivation would show)."""
    return any(
        not torch.equal(state["master_weight"][n], w.float()) for n, w in state["weights"].items()
    )


def test_exact_continuation_into_a_fresh_slot(trained):
    saved = trained.slot_state(0)
    assert saved["steps"] == K and masters_differ_from_weights(saved)
    trained.load_slot(3, "alice")
    assert differences(saved, trained.slot_state(3)) == []
    step_alone(trained, 0, [100, 101])
    step_alone(trained, 3, [100, 101])
    after = trained.slot_state(0)
    assert after["steps"] == K + 1
    assert differences(after, trained.slot_state(3)) == []
    assert differences(after, saved) != []  # the step did change slot 0


def test_negative_control_bf16_rounded_masters_are_caught(trained):
    trained.load_slot(3, "alice")
    optimizer = trained.slots[3].optimizer.optimizer
    rounded = 0
    with torch.no_grad():
        for param in trained.slots[3].params.parameters():
            master = optimizer.state[param]["master_weight"]
            bf16 = master.to(torch.bfloat16).float()
            rounded += int(not torch.equal(bf16, master))
            master.copy_(bf16)
    assert rounded > 0
    found = differences(trained.slot_state(0), trained.slot_state(3))
    assert found and all(d.startswith("master_weight.") for d in found)


def test_negative_control_weights_only_load_is_caught(trained):
    trained.load_slot(3, "alice", load_optimizer=False)
    found = differences(trained.slot_state(0), trained.slot_state(3))
    assert "exp_avg: names differ" in found and "steps" in found
    step_alone(trained, 0, [100, 101])
    step_alone(trained, 3, [100, 101])
    after = differences(trained.slot_state(0), trained.slot_state(3))
    assert any(d.startswith("weights.") for d in after)


def test_loading_one_slot_leaves_every_other_slots_masters_unchanged(trained):
    train(trained, 1, [0, 1, 2], start=200)  # slot 0 moves on from 'alice'
    others = {s: trained.slot_state(s) for s in (1, 2)}
    assert all(masters_differ_from_weights(state) for state in others.values())
    trained.load_slot(0, "alice")
    for slot, before in others.items():
        assert differences(before, trained.slot_state(slot)) == [], f"slot {slot} changed"


def test_a_step_updates_only_the_slots_in_the_batch(trained):
    trained.forward_backward(batch([300, 301], [2, 2]))  # slot 2 has pending gradients
    before = all_states(trained)
    trained.train_step(batch([302, 303, 304], [0, 1, 0]))
    after = all_states(trained)
    assert differences(before[2], after[2]) == []
    assert differences(before[0], after[0]) and differences(before[1], after[1])
    trained.optim_step(2)  # its gradients were kept
    assert trained.slot_state(2)["steps"] == K + 1


def test_optim_step_touches_no_other_slot(trained):
    trained.forward_backward(batch([300, 301, 302], [0, 1, 2]))
    before = all_states(trained)
    trained.optim_step(1)
    after = all_states(trained)
    assert differences(before[0], after[0]) == [] and differences(before[2], after[2]) == []
    assert differences(before[1], after[1])


def test_rows_use_only_their_slots_adapter(tmp_path):
    trainer = build(tmp_path, **{"model.dtype": "fp32"})
    for slot in (0, 1):
        trainer.create_slot(slot)
    train(trainer, 2, [0, 1])  # B != 0: the adapters now change the outputs
    rows, slots = [400, 401, 402, 403], [1, 0, 0, 1]
    mixed = logits(trainer, batch(rows, slots))
    for slot in (0, 1):
        mine = [i for i, s in enumerate(slots) if s == slot]
        alone = logits(trainer, batch([rows[i] for i in mine], [slot] * len(mine)))
        width = alone.shape[1]
        torch.testing.assert_close(mixed[mine, :width], alone, rtol=1e-5, atol=1e-5)
    other = logits(trainer, batch(rows, [1 - s for s in slots]))
    assert not torch.allclose(mixed, other)


def logits(trainer, inputs: dict) -> torch.Tensor:
    trainer.router.route(inputs["slot_ids"], sorted(set(inputs["slot_ids"].tolist())))
    try:
        with torch.no_grad():
            out = trainer.model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            )
    finally:
        trainer.router.clear()
    return out.logits


def test_rows_are_computed_grouped_by_slot(tmp_path, monkeypatch):
    """Per layer: one batched product pair over the slots, each slot's rows together."""
    trainer = build(tmp_path)
    for slot in (0, 1):
        trainer.create_slot(slot)
    calls: list[tuple[int, ...]] = []
    original = torch.bmm

    def counting(left, right):
        calls.append(tuple(left.shape))
        return original(left, right)

    monkeypatch.setattr(torch, "bmm", counting)
    inputs = batch(list(range(6)), [0, 1, 0, 1, 1, 0])
    trainer.forward_backward(inputs)
    layers = [m for m in trainer.model.modules() if isinstance(m, LoRALinear)]
    forward = calls[: 2 * len(layers)]  # autograd's backward does not call torch.bmm
    assert len(calls) == 2 * len(layers)
    seq = inputs["input_ids"].shape[1]
    assert {shape[:2] for shape in forward} == {(2, 3 * seq)}  # 2 slots x 3 rows each


def test_hyperparameters_are_per_slot_and_per_call(trained):
    trained.create_slot(3, lr=0.0, weight_decay=0.0)
    frozen = trained.slot_state(3)
    train(trained, 1, [0, 3], start=500)
    changed = differences(frozen, trained.slot_state(3))
    assert "steps" in changed and not [d for d in changed if d.startswith("weights")]
    trained.forward_backward(batch([510, 511], [0, 0]))
    trained.optim_step(0, lr=5e-3, betas=(0.8, 0.95), weight_decay=0.0)
    groups = trained.slot_state(0)["param_groups"]
    assert all(g["betas"] == [0.8, 0.95] and g["weight_decay"] == 0.0 for g in groups)
    assert trained.slots[0].optimizer.hyper.lr == 5e-3
    trained.save_slot(0, "tuned")
    trained.load_slot(1, "tuned")
    assert trained.slot_state(1)["param_groups"] == trained.slot_state(0)["param_groups"]
    assert trained.slots[1].optimizer.hyper == trained.slots[0].optimizer.hyper


def test_bad_calls_change_nothing(trained):
    before = all_states(trained)
    with pytest.raises(SlotError, match="unknown hyperparameters"):
        trained.create_slot(3, learning_rate=1.0)
    with pytest.raises(SlotError, match=r"r must be in \[1, 8\]"):
        trained.create_slot(3, r=9)
    with pytest.raises(SlotError, match="already exists"):
        trained.create_slot(0)
    with pytest.raises(SlotError, match="does not exist"):
        trained.forward_backward(batch([1, 2], [0, 3]))
    with pytest.raises(DataError, match="slot_ids"):
        trained.forward_backward(batch([1, 2], [0, 7]))
    with pytest.raises(SlotError, match="no accumulated gradients"):
        trained.optim_step(1)
    with pytest.raises(SlotError, match="slot 5: is not a slot index"):
        trained.optim_step(5)
    with pytest.raises(SlotError, match="lr"):
        trained.optim_step(0, lr=-1.0)
    assert_unchanged(before, trained)
    assert all(p.grad is None for s in trained.slots.values() for p in s.params.parameters())


def test_reset_and_release(tmp_path):
    trainer = build(tmp_path)
    trainer.create_slot(0, r=4, seed=7)
    fresh = trainer.slot_state(0)
    assert fresh["steps"] == 0 and fresh["master_weight"] == {}
    train(trainer, 2, [0])
    trainer.reset_slot(0)
    assert differences(fresh, trainer.slot_state(0)) == []
    trainer.release_slot(0)
    with pytest.raises(SlotError, match="does not exist"):
        trainer.slot_state(0)
    with pytest.raises(SlotError, match="does not exist"):
        trainer.train_step(batch([1], [0]))
    trainer.create_slot(0, r=4, seed=7)
    assert differences(fresh, trainer.slot_state(0)) == []


def test_a_lower_rank_slot_keeps_its_unused_rank_zero(tmp_path):
    """Batched with a full-rank slot, the lower-rank slot's unused rows of A and columns
    of B add exact zeros and stay zero."""
    trainer = build(tmp_path)
    trainer.create_slot(0, r=3)
    trainer.create_slot(1)
    train(trainer, 3, [0, 1])
    state = trainer.slot_state(0)
    for name, weight in state["weights"].items():
        unused = weight[3:] if ".lora_A." in name else weight[:, 3:]
        used = weight[:3] if ".lora_A." in name else weight[:, :3]
        assert not unused.any() and used.any(), name


def test_accumulated_gradients_are_the_token_mean(tmp_path):
    """Two forward_backward calls before a step equal one call with all their rows."""
    one, two = (
        build(tmp_path / "one", **{"model.dtype": "fp32"}),
        build(tmp_path / "two", **{"model.dtype": "fp32"}),
    )
    for trainer in (one, two):
        trainer.create_slot(0)
    one.forward_backward(batch([600, 601, 602], [0, 0, 0]))
    two.forward_backward(batch([600], [0]))
    two.forward_backward(batch([601, 602], [0, 0]))
    one.optim_step(0)
    two.optim_step(0)
    a, b = one.slot_state(0), two.slot_state(0)
    for name in a["weights"]:
        torch.testing.assert_close(a["exp_avg"][name], b["exp_avg"][name], rtol=1e-4, atol=1e-9)


#: Below every norm of these steps (the clip bites), above slot 0's first-step norm were its
#: gradient divided by the batch's tokens (so that wrong scale would not be clipped away).
CLIP = 0.3
MIXED_STEPS = [  # (slot 0's rows, slot 1's rows): slot 1 has more labelled tokens each step
    ([600, 601], [602, 603, 604, 605, 606]),
    ([610, 611], [612, 613, 614, 615, 616]),
]


def clipped_steps(tmp_path, name: str, slots: list[int]) -> tuple[list[dict], dict]:
    """Slots 0 and 1 created; MIXED_STEPS with the rows of ``slots`` only, each slot
    stepped after each forward_backward. Returns each step's results and the weights."""
    trainer = build(tmp_path / name, **{"model.dtype": "fp32", "train.grad_clip": CLIP})
    for slot in (0, 1):
        trainer.create_slot(slot)
    results = []
    for step_rows in MIXED_STEPS:
        rows = [row for slot in slots for row in step_rows[slot]]
        ids = [slot for slot in slots for _ in step_rows[slot]]
        losses = trainer.forward_backward(batch(rows, ids))
        results.append({s: {"tokens": losses[s].tokens, **trainer.optim_step(s)} for s in slots})
    return results, {s: trainer.slot_state(s)["weights"] for s in slots}


def test_a_slots_clipped_step_in_a_mixed_batch_equals_that_slot_trained_alone(tmp_path):
    """Each slot's gradient is the mean over its own tokens, not the batch's: its reported
    grad norm, and its weights after clipped steps, are those of the slot trained alone on
    its rows. (Adam is scale-invariant: a gradient divided by the wrong token count shows
    only in the norm, and in the weights once a clip bites on the right norm only.)"""
    mixed, mixed_weights = clipped_steps(tmp_path, "mixed", [0, 1])
    for slot in (0, 1):
        alone, alone_weights = clipped_steps(tmp_path, f"alone{slot}", [slot])
        for step, (m, a) in enumerate(zip(mixed, alone, strict=True)):
            assert m[slot]["tokens"] == a[slot]["tokens"]
            assert a[slot]["grad_norm"] > CLIP, "the clip must bite"
            assert m[slot]["grad_norm"] == pytest.approx(a[slot]["grad_norm"], rel=1e-5), (
                f"slot {slot}, step {step}"
            )
        # FP32 products over another batch make the gradients differ in their last bits, and
        # Adam turns that into up to ~4e-6 on a weight whose gradient is near zero; the
        # whole batch's token count instead of the slot's moves weights by ~7e-4.
        for name, weight in alone_weights[slot].items():
            torch.testing.assert_close(
                mixed_weights[slot][name],
                weight,
                rtol=1e-5,
                atol=5e-5,
                msg=lambda why, name=name: f"{name}: {why}",
            )
    assert all(m[0]["tokens"] != m[1]["tokens"] for m in mixed)  # the batch's count differs


def pending_step_of_slot_0(tmp_path, name: str, *, load_into_1: bool) -> tuple[dict, dict]:
    """Slots 0 (tenant A) and 1 (tenant B) trained, B saved; A's forward_backward, then
    (if ``load_into_1``) B loads its checkpoint into slot 1, then A's optim_step."""
    trainer = build(tmp_path / name)
    for slot in (0, 1):
        trainer.create_slot(slot)
    train(trainer, 2, [0, 1])
    trainer.save_slot(1, "bob")
    trainer.forward_backward(batch([800, 801, 802], [0, 0, 0]))
    if load_into_1:
        trainer.load_slot(1, "bob")
    return trainer.optim_step(0), trainer.slot_state(0)


def test_a_load_into_another_slot_keeps_this_slots_pending_gradients(tmp_path):
    """Tenant B loading into slot 1 between tenant A's forward_backward and A's optim_step
    changes nothing of A's step: bitwise the step of the same sequence without B's load."""
    expected, expected_state = pending_step_of_slot_0(tmp_path, "plain", load_into_1=False)
    result, state = pending_step_of_slot_0(tmp_path, "loaded", load_into_1=True)
    assert expected["grad_norm"] > 0
    assert result == expected
    assert differences(expected_state, state) == []
