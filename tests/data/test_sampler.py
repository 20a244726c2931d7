"""GlobalBatchSampler: seeded order, checkpointable position, the same global batches on any dp size."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from veoptim.data import GlobalBatchSampler
from veoptim.errors import CheckpointError, ConfigError, DataError

N, GLOBAL, MICRO, SEED = 103, 16, 2, 7  # 6 full steps per epoch, 7 examples dropped


def sampler(
    dp_rank: int = 0, dp_size: int = 1, seed: int = SEED, micro: int = MICRO
) -> GlobalBatchSampler:
    return GlobalBatchSampler(N, GLOBAL, micro, dp_rank, dp_size, seed)


def flat(step: list[list[int]]) -> list[int]:
    return [i for micro in step for i in micro]


def test_same_seed_gives_the_same_order_and_another_seed_a_different_one():
    a, b, c = sampler(), sampler(), sampler(seed=SEED + 1)
    steps_a = [a.next_step() for _ in range(20)]
    assert steps_a == [b.next_step() for _ in range(20)]
    assert steps_a != [c.next_step() for _ in range(20)]


def test_step_is_split_into_micro_batches_of_this_rank():
    s = sampler(dp_rank=1, dp_size=2, micro=4)
    step = s.next_step()
    assert s.grad_accum_steps == 2 and [len(m) for m in step] == [4, 4]


def test_order_ignores_and_leaves_global_rngs_untouched():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    first = [sampler().next_step() for _ in range(3)]
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    assert [sampler().next_step() for _ in range(3)] == first


def test_epoch_visits_distinct_examples_drops_the_tail_and_rolls_over():
    s = sampler()
    assert s.steps_per_epoch == N // GLOBAL == 6
    epoch0 = [flat(s.next_step()) for _ in range(s.steps_per_epoch)]
    assert (s.epoch, s.step_in_epoch) == (1, 0)
    seen = [i for step in epoch0 for i in step]
    assert len(seen) == len(set(seen)) == 6 * GLOBAL and set(seen) <= set(range(N))
    epoch1 = [flat(s.next_step()) for _ in range(s.steps_per_epoch)]
    assert (s.epoch, s.step_in_epoch) == (2, 0)
    assert epoch1 != epoch0 and len({i for step in epoch1 for i in step}) == 6 * GLOBAL


def test_resumed_sampler_continues_the_uninterrupted_order():
    for stop in (0, 3, 5, 6, 9):  # fresh, mid-epoch, last step of an epoch, boundary, next epoch
        reference = sampler()
        uninterrupted = [reference.next_step() for _ in range(stop + 10)]
        first = sampler()
        for _ in range(stop):
            first.next_step()
        state = json.loads(json.dumps(first.state_dict()))
        resumed = sampler()
        resumed.load_state_dict(state)
        assert (resumed.epoch, resumed.step_in_epoch) == (first.epoch, first.step_in_epoch)
        assert [resumed.next_step() for _ in range(10)] == uninterrupted[stop:]


def test_negative_control_fresh_sampler_does_not_continue_the_order():
    reference = sampler()
    uninterrupted = [reference.next_step() for _ in range(8)]
    assert [sampler().next_step() for _ in range(5)] != uninterrupted[3:]


def test_union_over_ranks_of_each_step_is_independent_of_dp_size():
    single = sampler(dp_size=1)
    expected = [flat(single.next_step()) for _ in range(15)]
    for dp_size in (2, 4, 8):
        ranks = [sampler(dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        for step in expected:
            shares = [flat(rank.next_step()) for rank in ranks]
            assert [i for share in shares for i in share] == step
            assert all(len(share) == GLOBAL // dp_size for share in shares)


def test_resume_on_another_dp_size_continues_the_same_global_batches():
    one_rank = sampler(dp_size=1)
    for _ in range(4):
        one_rank.next_step()
    state = one_rank.state_dict()
    expected = [flat(one_rank.next_step()) for _ in range(5)]
    ranks = [sampler(dp_rank=r, dp_size=4, micro=1) for r in range(4)]
    for rank in ranks:
        rank.load_state_dict(state)
    for step in expected:
        assert [i for rank in ranks for i in flat(rank.next_step())] == step


@pytest.mark.parametrize(
    ("global_batch", "micro", "dp_size", "message"),
    [
        (15, 1, 2, r"multiple of the data-parallel size 2"),
        (16, 3, 2, r"valid choices are \[1, 2, 4, 8\]"),
        (16, 0, 1, r"valid choices are \[1, 2, 4, 8, 16\]"),
        (0, 1, 1, r"positive multiple"),
    ],
)
def test_batch_sizes_that_do_not_divide_raise_config_error_with_valid_choices(
    global_batch, micro, dp_size, message
):
    with pytest.raises(ConfigError, match=message):
        GlobalBatchSampler(N, global_batch, micro, 0, dp_size, SEED)


def test_dataset_smaller_than_a_global_batch_raises_data_error():
    with pytest.raises(DataError, match="fewer than one global batch"):
        GlobalBatchSampler(GLOBAL - 1, GLOBAL, MICRO, 0, 1, SEED)


@pytest.mark.parametrize(
    ("key", "value"),
    [("seed", SEED + 1), ("num_examples", N + 1), ("global_batch_size", 32), ("version", 99)],
)
def test_state_of_another_run_is_rejected_and_position_unchanged(key, value):
    source = sampler()
    source.next_step()
    state = source.state_dict() | {key: value}
    target = sampler()
    target.next_step()
    target.next_step()
    with pytest.raises(CheckpointError, match=key if key != "version" else "version"):
        target.load_state_dict(state)
    assert (target.epoch, target.step_in_epoch) == (0, 2)


def test_state_saved_over_other_data_is_rejected_and_position_unchanged():
    source = GlobalBatchSampler(N, GLOBAL, MICRO, 0, 1, SEED, data_fingerprint="a" * 64)
    source.next_step()
    target = GlobalBatchSampler(N, GLOBAL, MICRO, 0, 1, SEED, data_fingerprint="b" * 64)
    with pytest.raises(CheckpointError, match="training data differs"):
        target.load_state_dict(source.state_dict())
    assert (target.epoch, target.step_in_epoch) == (0, 0)
    # Control: the same fingerprint continues.
    same = GlobalBatchSampler(N, GLOBAL, MICRO, 0, 1, SEED, data_fingerprint="a" * 64)
    same.load_state_dict(source.state_dict())
    assert (same.epoch, same.step_in_epoch) == (0, 1)


def test_state_with_step_outside_the_epoch_is_rejected():
    state = sampler().state_dict() | {"step_in_epoch": 6}
    with pytest.raises(CheckpointError, match="outside"):
        sampler().load_state_dict(state)
