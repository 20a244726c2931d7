"""Two gloo ranks publishing together: one version directory for all ranks, and a failure
on any rank in any phase makes both raise the same error promptly and keeps the previous
version published (scenarios run in tests/checkpoint/helpers/multirank.py)."""

from __future__ import annotations

import pytest

from tests.checkpoint.helpers.multirank import results

pytestmark = [pytest.mark.slow, pytest.mark.multirank]
FAILURES = ["fail_write", "fail_prepared", "fail_written", "fail_before_replace", "fail_async"]


def test_all_ranks_write_into_one_version_and_it_is_published() -> None:
    r = results()
    assert r[0]["first"]["error"] is None and r[0]["first"]["value"] == r[1]["first"]["value"]
    assert r[0]["first_state"]["resolved"] == r[0]["published_first"]
    assert len(r[0]["first_state"]["versions"]) == 1


@pytest.mark.parametrize("scenario", FAILURES)
def test_failure_on_one_rank_raises_the_same_error_on_every_rank(scenario: str) -> None:
    r = results()
    errors = {r[rank][scenario]["error"] for rank in (0, 1)}
    assert len(errors) == 1 and None not in errors
    (error,) = errors
    assert "failed on rank" in error
    assert max(r[rank][scenario]["seconds"] for rank in (0, 1)) < 15


@pytest.mark.parametrize("scenario", FAILURES)
def test_failure_on_one_rank_keeps_the_previous_version_published(scenario: str) -> None:
    r = results()
    for rank in (0, 1):
        state = r[rank][f"{scenario}_state"]
        assert state["resolved"] == r[0]["published_first"]
        assert state["versions"] == r[0]["first_state"]["versions"]  # new one removed


def test_errors_name_the_failing_rank_phase_and_cause() -> None:
    r = results()[0]
    assert "write into" in r["fail_write"]["error"]
    assert "rank 1 of 2: OSError: [Errno 28] No space left on device" in r["fail_write"]["error"]
    assert "prepare" in r["fail_prepared"]["error"] and "rank 1" in r["fail_prepared"]["error"]
    assert "write into" in r["fail_written"]["error"] and "rank 1" in r["fail_written"]["error"]
    assert "publish of" in r["fail_before_replace"]["error"]
    assert "rank 0" in r["fail_before_replace"]["error"]
    assert "async write failed" in r["fail_async"]["error"]


def test_next_save_after_failures_succeeds_and_applies_retention() -> None:
    r = results()
    assert r[0]["second"]["error"] is None and r[1]["second"]["error"] is None
    assert r[0]["second_state"]["resolved"] != r[0]["published_first"]
    assert r[0]["names"] == ["ckpt"]


def test_resolve_agreed_gives_every_rank_the_same_version_or_the_same_error() -> None:
    r = results()
    assert r[0]["agreed_auto"] == r[1]["agreed_auto"] == r[0]["second_state"]["resolved"]
    errors = {r[rank]["agreed_missing"]["error"] for rank in (0, 1)}
    assert len(errors) == 1 and "No checkpoint named 'nope'" in errors.pop()
