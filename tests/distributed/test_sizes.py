"""Parallel degrees: -1 filling and clear errors (with the valid choices) for invalid meshes."""

from __future__ import annotations

import pytest

from veoptim.config.schema import ParallelConfig
from veoptim.distributed import ParallelSizes, resolve_parallel_sizes
from veoptim.errors import ConfigError


def sizes(world: int, experts: int = 0, **kw) -> ParallelSizes:
    return resolve_parallel_sizes(ParallelConfig(**kw), world, experts)


def test_dp_shard_fills_the_world_by_default():
    assert sizes(8) == ParallelSizes(world=8, dp_replicate=1, dp_shard=8, ep=1)


def test_dp_replicate_fills_the_rest():
    assert sizes(8, dp_replicate=-1, dp_shard=4) == ParallelSizes(
        world=8, dp_replicate=2, dp_shard=4, ep=1
    )


def test_ep_borrows_from_dp_shard():
    s = sizes(16, experts=8, dp_replicate=2, ep=4)
    assert (s.dp_shard, s.ep, s.efsdp) == (8, 4, 2)


def test_replicate_times_shard_must_equal_the_world():
    with pytest.raises(
        ConfigError,
        match=r"must equal the world size 4, got 2x4=8; valid .*\['1x4', '2x2', '4x1'\]",
    ):
        sizes(4, dp_replicate=2, dp_shard=4)


def test_dp_shard_that_does_not_divide_the_world_lists_divisors():
    with pytest.raises(
        ConfigError,
        match=r"parallel.dp_shard=3 must divide the world size 4; valid choices: \[1, 2, 4\]",
    ):
        sizes(4, dp_replicate=-1, dp_shard=3)


def test_dp_replicate_that_does_not_divide_the_world_lists_divisors():
    with pytest.raises(
        ConfigError, match=r"parallel.dp_replicate=3 must divide the world size 4; valid choices"
    ):
        sizes(4, dp_replicate=3)


def test_both_fill_is_rejected():
    with pytest.raises(ConfigError, match="at most one of"):
        sizes(4, dp_replicate=-1, dp_shard=-1)


@pytest.mark.parametrize("key", ["dp_replicate", "dp_shard", "ep"])
def test_zero_degree_is_rejected(key):
    with pytest.raises(ConfigError, match=f"parallel.{key} must be a positive integer"):
        sizes(4, experts=4, **{key: 0})


def test_ep_must_divide_dp_shard():
    with pytest.raises(
        ConfigError,
        match=r"parallel.ep=4 must divide parallel.dp_shard=2 .*valid choices: \[1, 2\]",
    ):
        sizes(4, experts=8, dp_replicate=2, ep=4)


def test_ep_must_divide_the_number_of_experts():
    with pytest.raises(
        ConfigError, match=r"must divide the number of experts \(6\); valid choices: \[1, 2\]"
    ):
        sizes(4, experts=6, ep=4)


def test_ep_on_a_dense_model_is_rejected():
    with pytest.raises(ConfigError, match="parallel.ep=2 needs a mixture-of-experts model"):
        sizes(2, experts=0, ep=2)


def test_ep_larger_than_one_process_is_rejected():
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide parallel.dp_shard=1"):
        sizes(1, experts=4, ep=2)
