"""``sample_tokens`` at batch scale: the shared prefill of the samples of one prompt, the
compaction of stopped rows and the router's held weights change how a batch is computed,
not what a row samples.

- Shared prefill: seeded and greedy rows, slot and base rows, with prompt log-probs, give
  bitwise the tokens, log-probs and prompt log-probs of the unshared path, in FP32 and in
  BF16. Only the prefill's batch shape changes (one row per prompt and slot instead of one
  per sample); each op of the forward computes a row from that row alone, and the matrix
  kernels of this CPU sum in the same order for either row count (measured bitwise; a
  kernel whose summation order depended on the row count would break it).
- Compaction: the same tokens and stop reasons; log-probs within 1e-5 in FP32 (measured
  <= 1e-6): the decode steps after it run fewer rows, and this CPU's FP32 matrix kernels
  pick another summation order for another small row count (BF16 measured bitwise).
- A generation advanced a few steps at a time, with another slot training between its
  steps (what the service's worker does to serve other tenants meanwhile), samples
  bitwise what one uninterrupted run does; a slot it samples from that is released or
  replaced meanwhile fails it instead of sampling from another adapter.
- The router's weights stacked once per generation, and its skipped gathers for rows in
  slot-major order, compute bitwise what a stack per forward and the gathers do, in
  sampling and in a training step's gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.slots.helpers import batch, build, train
from veoptim.errors import SlotError
from veoptim.slots.routing import SlotRouter
from veoptim.slots.tokens import Generation, SampleRow, sample_tokens

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def trainer(request, tmp_path_factory):
    trainer = build(tmp_path_factory.mktemp(request.param), **{"model.dtype": request.param})
    for slot in range(3):
        trainer.create_slot(slot, r=4 + 2 * slot, seed=slot)
    train(trainer, 2, [0, 1, 2])  # trained adapters: every slot samples differently
    return trainer


def prompts(trainer) -> list[list[int]]:
    vocab = trainer.model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (19, 6, 11)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def slot_rows(trainer) -> list[SampleRow]:
    """Groups of samples of one prompt and slot, and rows sharing nothing."""
    p = prompts(trainer)
    stops = frozenset(range(3, trainer.model.config.vocab_size, 9))
    return [
        *[SampleRow(p[0], 0, 12, 1.0, top_k=40, top_p=0.9, generator=gen(10 + i),
                    prompt_logprobs=i == 0) for i in range(4)],
        *[SampleRow(p[1], 1, 12, 0.0, prompt_logprobs=True) for _ in range(2)],
        SampleRow(p[0], 2, 12, 0.7, generator=gen(30)),  # the group's prompt, another slot
        *[SampleRow(p[2], 1, 12, 1.0, generator=gen(40 + i), stop_ids=stops) for i in range(3)],
        SampleRow(p[0], 0, 5, 1.0, generator=gen(50)),  # the group's prompt and slot, apart
    ]  # fmt: skip


def base_rows(trainer) -> list[SampleRow]:
    p = prompts(trainer)
    return [SampleRow(p[2], None, 10, 0.0 if i == 0 else 1.0, generator=gen(60 + i),
                      prompt_logprobs=True) for i in range(3)]  # fmt: skip


def fresh(rows: list[SampleRow]) -> list[SampleRow]:
    """The rows again with their generators at their seeds."""
    return [SampleRow(**{**r.__dict__, "generator": None if r.generator is None
                         else gen(r.generator.initial_seed())}) for r in rows]  # fmt: skip


def batch_sizes(trainer, call) -> tuple[list[int], list]:
    """``call()``'s result and the row count of each forward it ran."""
    sizes: list[int] = []
    hook = trainer.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        return sizes, call()
    finally:
        hook.remove()


def outcome(sampled) -> list[tuple]:
    return [(s.tokens, s.logprobs, s.stopped,
             None if s.prompt_logprobs is None else s.prompt_logprobs.tolist())
            for s in sampled]  # fmt: skip


def same(a: list[tuple], b: list[tuple]) -> bool:
    """Bitwise, NaN (position 0 of the prompt log-probs) equal to NaN."""

    def eq(x, y):
        return x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))

    return all(
        ta == tb and la == lb and sa == sb and (pa is None) == (pb is None)
        and (pa is None or all(eq(x, y) for x, y in zip(pa, pb, strict=True)))
        for (ta, la, sa, pa), (tb, lb, sb, pb) in zip(a, b, strict=True)
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["slot", "base"])
def test_a_shared_prefill_samples_bitwise_like_one_prefill_per_row(trainer, kind):
    rows = slot_rows(trainer) if kind == "slot" else base_rows(trainer)
    shared_sizes, shared = batch_sizes(
        trainer, lambda: sample_tokens(trainer, fresh(rows), compact=False)
    )
    alone_sizes, alone = batch_sizes(
        trainer, lambda: sample_tokens(trainer, fresh(rows), share_prefill=False, compact=False)
    )
    prefills = len({(tuple(r.prompt), r.slot) for r in rows})
    assert shared_sizes[0] == prefills < len(rows) == alone_sizes[0]
    assert set(shared_sizes[1:]) == set(alone_sizes[1:]) == {len(rows)}
    assert same(outcome(shared), outcome(alone))
    draws = {tuple(s.tokens) for s, r in zip(shared, rows, strict=True) if r.temperature}
    assert len(draws) > 1  # the samples of one prompt differ


def test_stopped_rows_leave_the_batch_and_the_others_sample_the_same(trainer):
    stops = frozenset(range(3, trainer.model.config.vocab_size, 4))
    p = prompts(trainer)
    rows = [SampleRow(p[i % 3], i % 3, 16, 1.0, generator=gen(70 + i), stop_ids=stops)
            for i in range(8)]  # fmt: skip
    sizes, compacted = batch_sizes(trainer, lambda: sample_tokens(trainer, fresh(rows)))
    full_sizes, full = batch_sizes(
        trainer, lambda: sample_tokens(trainer, fresh(rows), compact=False)
    )
    assert min(sizes) < len(rows) and set(full_sizes[1:]) == {len(rows)}
    assert sum(sizes) < sum(full_sizes)
    assert [(s.tokens, s.stopped) for s in compacted] == [(s.tokens, s.stopped) for s in full]
    for a, b in zip(compacted, full, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs),
                                   rtol=0, atol=1e-5)  # fmt: skip
        if trainer.model.dtype == torch.bfloat16:
            assert a.logprobs == b.logprobs  # measured bitwise in BF16


def test_held_weights_sample_what_a_stack_per_forward_does_also_after_training(
    trainer, monkeypatch
):
    rows = slot_rows(trainer)

    def both() -> tuple[list[tuple], list[tuple]]:
        held = outcome(sample_tokens(trainer, fresh(rows)))
        with monkeypatch.context() as m:
            m.setattr(SlotRouter, "hold_weights", lambda self: None)
            return held, outcome(sample_tokens(trainer, fresh(rows)))

    held, stacked = both()
    assert same(held, stacked)
    train(trainer, 1, [0, 1], start=40)  # new weights: nothing of the last generation stays
    held_after, stacked_after = both()
    assert same(held_after, stacked_after) and not same(held_after, held)


def test_rows_in_slot_order_train_bitwise_like_the_gathers(trainer, monkeypatch):
    rows = batch([3, 4, 5, 6], [1, 1, 2, 2])  # slot-major, as many rows per slot

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        losses = trainer.forward_backward(rows)
        grads = {f"{s}.{n}": p.grad.clone() for s in (1, 2)
                 for n, p in trainer.slots[s].params.named}  # fmt: skip
        for s in (1, 2):
            trainer.slots[s].optimizer.zero_grad()
        return [v.loss_sum for v in losses.values()], grads

    route = SlotRouter.route
    in_order: list[bool] = []

    def spy(self, slot_ids, slots):
        route(self, slot_ids, slots)
        in_order.append(self._in_order)

    monkeypatch.setattr(SlotRouter, "route", spy)
    fast = step()
    assert in_order == [True]

    def gathered(self, slot_ids, slots):
        route(self, slot_ids, slots)
        self._in_order = False

    monkeypatch.setattr(SlotRouter, "route", gathered)
    slow = step()
    assert fast[0] == slow[0]
    assert all(torch.equal(fast[1][k], slow[1][k]) for k in fast[1])


@pytest.mark.parametrize("kind", ["slot", "base"])
def test_a_generation_in_steps_with_training_between_samples_like_one_run(trainer, kind):
    rows = slot_rows(trainer) if kind == "slot" else base_rows(trainer)
    whole = outcome(sample_tokens(trainer, fresh(rows)))
    trainer.create_slot(3, r=4, seed=3)  # another tenant's slot, trained between the steps
    try:
        generation, turns = Generation(trainer, fresh(rows)), 0
        before = {n: p.detach().clone() for n, p in trainer.slots[3].params.named}
        while not generation.advance(3):
            train(trainer, 1, [3], start=60 + turns)
            turns += 1
        assert turns >= 2  # the steps really were interleaved with training
        assert any(not torch.equal(before[n], p) for n, p in trainer.slots[3].params.named)
        assert same(outcome(generation.results()), whole)
    finally:
        trainer.release_slot(3)


def test_a_slice_of_seconds_ends_after_the_step_during_which_they_passed(trainer):
    rows = slot_rows(trainer)
    whole = outcome(sample_tokens(trainer, fresh(rows)))
    generation = Generation(trainer, fresh(rows))
    lengths, calls = [], 0
    while not generation.advance(seconds=0.0):  # time is up at once: one step per call
        calls += 1
        lengths.append(max(len(o.tokens) for o in generation.out))
    assert lengths == list(range(1, calls + 1)) and calls >= 4
    assert same(outcome(generation.results()), whole)
    generation = Generation(trainer, fresh(rows))
    assert generation.advance(seconds=60.0)  # a slice longer than the generation: all of it
    assert same(outcome(generation.results()), whole)


def test_a_generation_fails_when_a_slot_it_samples_from_is_replaced(trainer):
    rows = [r for r in slot_rows(trainer) if r.slot == 1]
    generation = Generation(trainer, fresh(rows))
    assert not generation.advance(2)
    trainer.release_slot(1)  # the module's last test: its trainer is not used again
    trainer.create_slot(1, r=6, seed=99)  # the same index, another adapter
    with pytest.raises(SlotError, match="released or replaced while a generation sampled"):
        generation.advance()
    with pytest.raises(RuntimeError, match="has not finished"):
        generation.results()
