"""The futures table's per-tenant limit of unfinished requests, and the engine's record of
used seq_ids: both stay exact however long a server runs, at a cost per request that does
not grow with the requests it has answered."""

from __future__ import annotations

import pytest

from veoptim.service.db import Database, ModelStatus
from veoptim.service.engine import MAX_AHEAD, Engine, Model, Op
from veoptim.service.errors import ServiceError
from veoptim.service.futures import FutureTable


def table(tmp_path, limit: int) -> FutureTable:
    return FutureTable(Database(tmp_path / "db.sqlite"), limit)


def test_the_limit_counts_each_tenants_unfinished_requests(tmp_path):
    futures = table(tmp_path, 2)
    a1, a2 = futures.create(1, "a", "x"), futures.create(1, "a", "x")
    futures.create(2, "b", "x")  # another tenant's do not count
    with pytest.raises(ServiceError, match="already has 2 unfinished requests"):
        futures.create(1, "a", "x")
    futures.create(1, "a", "x", limited=False)  # a model's next request always runs
    futures.finish(a1, {"ok": 1})
    futures.finish(a1, {"ok": 2})  # a second completion changes nothing
    with pytest.raises(ServiceError, match="already has 2 unfinished requests"):
        futures.create(1, "a", "x")  # 2 still pending: a2 and the unlimited one
    futures.fail(a2, "boom", "user")
    futures.create(1, "a", "x")
    assert sorted(f.tenant_id for f in futures.pending()) == [1, 1, 2]


def test_finished_results_leave_the_count_when_swept(tmp_path):
    futures = table(tmp_path, 1)
    done = futures.create(1, "a", "x")
    futures.finish(done, {"ok": 1})
    futures.retrieved(done)
    futures.sweep(now=done.retrieved_at + 10**6)
    futures.create(1, "a", "x")
    with pytest.raises(ServiceError, match="already has 1 unfinished requests"):
        futures.create(1, "a", "x")


def test_used_seq_ids_are_remembered_for_a_window_and_pruned_in_bulk(tmp_path):
    engine = Engine(table(tmp_path, 10**6), batch_tenants=False, gap_timeout_s=60,
                    run_batch=lambda ops: [{} for _ in ops])  # fmt: skip
    model = Model("m", 1, "s", status=ModelStatus.READY, next_seq=1)
    engine.add_model(model)
    sizes = []
    last = 5 * MAX_AHEAD
    for seq in range(1, last + 1):  # the worker is not started: the model's next_seq stays
        model.next_seq = seq  # as if each request ran at once
        engine.submit(1, model, seq, "op", lambda: Op("op", None), idempotency_key=f"k{seq}")
        model.queue.clear()
        sizes.append(len(model.seen))
    assert max(sizes) == 4 * MAX_AHEAD  # one more: a bulk prune back to the window
    assert sizes[4 * MAX_AHEAD] == min(sizes[4 * MAX_AHEAD :]) == 2 * MAX_AHEAD + 1
    retried = engine.submit(
        1, model, last, "op", lambda: Op("op", None), idempotency_key=f"k{last}"
    )
    assert retried is model.seen[last][1]  # a retry within the window gets its future back
    with pytest.raises(ServiceError, match=f"seq_id {last - MAX_AHEAD} was already used"):
        engine.submit(1, model, last - MAX_AHEAD, "op", lambda: Op("op", None))
