"""Cross-rank agreement (veoptim/distributed/agreement.py): one failure anywhere makes every
rank raise the same CheckpointError naming the rank(s) and cause, promptly, without hangs."""

from __future__ import annotations

import pytest

from tests.checkpoint.helpers.multirank import results
from veoptim.distributed.agreement import agree, broadcast_from_rank0, on_rank0, rank, world_size
from veoptim.errors import CheckpointError

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def test_single_process_success_returns() -> None:
    assert agree(True, "phase") is None
    assert (rank(), world_size(), broadcast_from_rank0("x")) == (0, 1, "x")


def test_single_process_failure_names_rank_and_cause_and_chains_it() -> None:
    cause = OSError(28, "No space left on device", "/ckpt/shard")
    with pytest.raises(CheckpointError) as info:
        agree(cause, "checkpoint 'x' write")
    assert str(info.value) == (
        "checkpoint 'x' write failed on rank 0 of 1: "
        "OSError: [Errno 28] No space left on device: '/ckpt/shard'"
    )
    assert info.value.__cause__ is cause


def test_false_is_a_failure_without_a_cause() -> None:
    with pytest.raises(CheckpointError, match="reported failure"):
        agree(False, "phase")


def test_all_ranks_succeeding_raises_nothing() -> None:
    assert all(results()[r]["agree_ok"]["error"] is None for r in (0, 1))


def test_one_failing_rank_makes_every_rank_raise_the_same_error() -> None:
    errors = {results()[r]["agree_one"]["error"] for r in (0, 1)}
    assert errors == {"test phase failed on rank 1 of 2: ValueError: boom on 1"}


def test_several_failing_ranks_are_all_named() -> None:
    errors = {results()[r]["agree_both"]["error"] for r in (0, 1)}
    assert errors == {
        "test phase failed on ranks 0, 1 of 2: rank 0: ValueError: boom on 0; "
        "rank 1: ValueError: boom on 1"
    }


def test_failing_rank_waits_only_for_its_slowest_peer() -> None:
    outcome = [results()[r]["agree_slow_peer"] for r in (0, 1)]
    assert outcome[0]["error"] == outcome[1]["error"] != None  # noqa: E711
    assert 0.9 <= outcome[0]["seconds"] < 10  # bounded by the peer's 1 s, no hang


def test_agreement_on_a_subgroup_names_global_ranks() -> None:
    errors = {results()[r]["agree_subgroup"]["error"] for r in (0, 1)}
    assert errors == {"subgroup phase failed on rank 1 of 2: KeyError: 'k'"}


def test_on_rank0_returns_the_decision_and_turns_its_error_into_the_agreed_one() -> None:
    assert on_rank0(lambda: "decided", "deciding") == "decided"
    cause = OSError(2, "No such file or directory", "/ckpt")
    with pytest.raises(CheckpointError) as info:
        on_rank0(lambda: (_ for _ in ()).throw(cause), "listing /ckpt")
    assert str(info.value).startswith("listing /ckpt failed on rank 0 of 1: FileNotFoundError:")
    assert info.value.__cause__ is cause
