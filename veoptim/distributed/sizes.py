"""Parallel degrees from config: validation and ``-1`` filling, before any process group is touched.

The world is ``dp_replicate x dp_shard``; expert parallelism borrows from
``dp_shard`` as in torchtitan: ``dp_shard = efsdp x ep``. Every rank of the
world reads distinct data.
"""

from __future__ import annotations

from dataclasses import dataclass

from veoptim.arith import divisors
from veoptim.config.schema import ParallelConfig
from veoptim.errors import ConfigError

FILL = -1


@dataclass(frozen=True)
class ParallelSizes:
    """Resolved degrees; ``world == dp_replicate * efsdp * ep`` always holds."""

    world: int
    dp_replicate: int
    dp_shard: int
    ep: int

    @property
    def efsdp(self) -> int:
        """FSDP degree of expert parameters (the part of dp_shard that EP does not use)."""
        return self.dp_shard // self.ep


def _check_degree(name: str, value: int, allow_fill: bool) -> None:
    if value == FILL and allow_fill:
        return
    if value < 1:
        fill = " (or -1 to fill the rest of the world size)" if allow_fill else ""
        raise ConfigError(f"parallel.{name} must be a positive integer{fill}, got {value}.")


def resolve_parallel_sizes(cfg: ParallelConfig, world_size: int, num_experts: int) -> ParallelSizes:
    """Check the degrees against the world size and the model; fill ``-1``.

    ``num_experts`` is 0 for dense models. Errors name the valid choices.
    """
    _check_degree("dp_replicate", cfg.dp_replicate, allow_fill=True)
    _check_degree("dp_shard", cfg.dp_shard, allow_fill=True)
    _check_degree("ep", cfg.ep, allow_fill=False)
    if cfg.dp_replicate == FILL and cfg.dp_shard == FILL:
        raise ConfigError(
            "at most one of parallel.dp_replicate and parallel.dp_shard may be -1, got both."
        )
    valid = divisors(world_size)
    replicate, shard = cfg.dp_replicate, cfg.dp_shard
    if replicate == FILL:
        if shard not in valid:
            raise ConfigError(
                f"parallel.dp_shard={shard} must divide the world size {world_size}; valid choices: {valid}."
            )
        replicate = world_size // shard
    elif shard == FILL:
        if replicate not in valid:
            raise ConfigError(
                f"parallel.dp_replicate={replicate} must divide the world size {world_size}; valid choices: {valid}."
            )
        shard = world_size // replicate
    elif replicate * shard != world_size:
        pairs = [f"{d}x{world_size // d}" for d in valid]
        raise ConfigError(
            f"parallel.dp_replicate x parallel.dp_shard must equal the world size {world_size}, "
            f"got {replicate}x{shard}={replicate * shard}; valid (dp_replicate x dp_shard): {pairs}, "
            f"or set one of them to -1."
        )
    ep = cfg.ep
    if ep > 1 and num_experts == 0:
        raise ConfigError(
            f"parallel.ep={ep} needs a mixture-of-experts model, but the model has no experts; use ep=1."
        )
    if shard % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide parallel.dp_shard={shard} (expert parallelism borrows from "
            f"dp_shard); valid choices: {_valid_ep(shard, num_experts)}."
        )
    if num_experts and num_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide the number of experts ({num_experts}); "
            f"valid choices: {_valid_ep(shard, num_experts)}."
        )
    return ParallelSizes(world=world_size, dp_replicate=replicate, dp_shard=shard, ep=ep)


def _valid_ep(dp_shard: int, num_experts: int) -> list[int]:
    return [d for d in divisors(dp_shard) if not num_experts or num_experts % d == 0]


def rank_slice(count: int, rank: int, world: int) -> range:
    """Rank ``rank``'s contiguous share of ``count`` items (shares differ by at most one;
    empty when ``count < world``)."""
    return range(count * rank // world, count * (rank + 1) // world)
