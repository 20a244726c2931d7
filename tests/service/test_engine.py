"""The worker's order and batching, without HTTP: a model's requests run in seq_id order
whatever order they arrive in, a gap times out, and heads of several models' queues are
batched (with serve.batch_tenants) into one slot batch whose results match lone runs to
float rounding."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.service.helpers import BASE_MODEL, datum
from veoptim.service.db import Database, ModelStatus
from veoptim.service.engine import Engine, Model, Op
from veoptim.service.errors import ServiceError
from veoptim.service.futures import FutureTable
from veoptim.service.wire import ForwardBackwardRequest, decode_forward_backward

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class Joinable:
    def joins(self, other) -> bool:
        return isinstance(other, Joinable)


def engine(tmp_path, batch_tenants=True, gap=10.0) -> tuple[Engine, list]:
    ran: list = []

    def run_batch(ops: list[Op]) -> list[dict]:
        ran.append([o.kind for o in ops])
        return [{} for _ in ops]

    futures = FutureTable(Database(tmp_path / "db.sqlite"), 100)
    e = Engine(futures, batch_tenants=batch_tenants, gap_timeout_s=gap, run_batch=run_batch)
    return e, ran


def add(e: Engine, name: str) -> Model:
    model = Model(name, 1, "s", status=ModelStatus.READY, next_seq=1)
    e.add_model(model)
    return model


def test_requests_run_in_seq_id_order_and_a_gap_times_out(tmp_path):
    e, ran = engine(tmp_path, gap=0.3)
    m = add(e, "m")
    order: list[int] = []
    for seq in (3, 1, 2):
        e.submit(
            1, m, seq, f"op{seq}", lambda s=seq: Op(f"op{s}", None, run=lambda: order.append(s))
        )
    e.start()
    stuck = e.submit(1, m, 5, "op5", lambda: Op("op5", None, run=lambda: order.append(5)))
    deadline = time.monotonic() + 10
    while stuck.status == "pending" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert order == [1, 2, 3] and stuck.status == "failed" and "seq_id 4" in stuck.error
    with pytest.raises(ServiceError, match="already used"):
        e.submit(1, m, 2, "again", lambda: Op("again", None, run=lambda: None))
    e.stop(5)


@pytest.mark.parametrize("batch_tenants", [True, False])
def test_heads_of_several_models_run_as_one_batch(tmp_path, batch_tenants):
    e, ran = engine(tmp_path, batch_tenants=batch_tenants)
    a, b = add(e, "a"), add(e, "b")
    for model in (a, b):
        e.submit(
            1, model, 1, f"fb-{model.id}", lambda m=model: Op(f"fb-{m.id}", None, batch=Joinable())
        )
    e.start()
    deadline = time.monotonic() + 10
    while not e.idle() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ran == ([["fb-a", "fb-b"]] if batch_tenants else [["fb-a"], ["fb-b"]])
    e.stop(5)


def request(model_id: str, data: list[types.Datum]) -> ForwardBackwardRequest:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    sdk = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=1,
    )  # fmt: skip
    msg = forward_backward_request_to_proto(sdk)
    msg.forward_only = True
    return decode_forward_backward(msg.SerializeToString())


def test_a_batch_of_two_tenants_matches_their_lone_runs(server):
    sc = server.client("alice")
    clients = [sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=s).result()
               for s in (1, 2)]  # fmt: skip
    backend = server.service.backend
    models = [server.service.engine.models[c.model_id] for c in clients]
    data = [[datum([5, 6, 7, 8, 9, 10, 11])], [datum([12, 13, 14]), datum([15, 16, 17, 18])]]
    ops = [
        backend.prepare_forward_backward(m, request(m.id, d))
        for m, d in zip(models, data, strict=True)
    ]
    batched = backend.forward_backward(ops)
    for op, together in zip(ops, batched, strict=True):
        (alone,) = backend.forward_backward([op])
        got = deserialize_forward_backward_output(together)
        want = deserialize_forward_backward_output(alone)
        for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                g["logprobs"].to_numpy(), w["logprobs"].to_numpy(), rtol=1e-5, atol=1e-6
            )
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    sc.close("success").result()


# ---------------------------------------------------------------- fair scheduling
class Rows:
    """A batch part of ``rows`` rows that joins parts of the same ``kind``."""

    def __init__(self, kind: str, rows: int = 1) -> None:
        self.kind, self.rows = kind, rows

    def joins(self, other) -> bool:
        return isinstance(other, Rows) and other.kind == self.kind


def held_engine(tmp_path, schedule: str, max_rows: int = 64):
    """An engine whose first batch waits for ``release``: the test queues work behind it."""
    import threading

    ran: list[list[str]] = []
    started, release = threading.Event(), threading.Event()

    def run_batch(ops: list[Op]) -> list[dict]:
        ran.append([o.kind for o in ops])
        started.set()
        release.wait(10)
        return [{} for _ in ops]

    futures = FutureTable(Database(tmp_path / "db.sqlite"), 1000)
    e = Engine(futures, batch_tenants=True, gap_timeout_s=10, run_batch=run_batch,
               schedule=schedule, max_batch_rows=max_rows)  # fmt: skip
    return e, ran, started, release


def settle(e: Engine) -> None:
    deadline = time.monotonic() + 10
    while not e.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.idle()


def free(e: Engine, tenant: int, name: str, kind: str, rows: int = 1) -> None:
    e.submit(tenant, None, None, name, lambda: Op(name, None, batch=Rows(kind, rows)))


@pytest.mark.parametrize("schedule", ["fair", "fifo"])
def test_a_small_request_runs_in_the_batch_after_another_tenants_backlog_is_queued(
    tmp_path, schedule
):
    """Tenant 2's backlog of 8 sampling requests (8 rows each, 16 rows per batch) is
    queued while its first batch runs; tenant 1's request (another kind: it cannot join)
    arrives last. Fair: it runs in the very next batch. FIFO (the negative control): after
    the whole backlog."""
    e, ran, started, release = held_engine(tmp_path, schedule, max_rows=16)
    e.start()
    free(e, 2, "b0", "sample", 8)
    assert started.wait(10)
    for k in range(1, 9):
        free(e, 2, f"b{k}", "sample", 8)
    free(e, 1, "a", "forward")
    release.set()
    settle(e)
    e.stop(5)
    assert ran[0] == ["b0"]
    assert all(sum(8 for op in batch if op.startswith("b")) <= 16 for batch in ran)
    position = next(i for i, batch in enumerate(ran) if "a" in batch)
    assert position == (1 if schedule == "fair" else len(ran) - 1), ran
    assert schedule == "fifo" or position == 1
    assert [op for batch in ran for op in batch if op != "a"] == [f"b{k}" for k in range(9)]


def test_requests_that_join_are_taken_one_per_tenant_at_a_time_within_the_row_bound(tmp_path):
    """Tenant 2 queued 6 requests before tenants 1 and 3 queued 2 each: the next batch of
    6 rows takes the first of every tenant (longest unserved first), then the second of
    each; a request larger than the bound runs alone."""
    e, ran, started, release = held_engine(tmp_path, "fair", max_rows=6)
    e.start()
    free(e, 9, "hold", "x")
    assert started.wait(10)
    for k in range(6):
        free(e, 2, f"b{k}", "sample")
    for tenant, name in ((1, "a"), (3, "c")):
        for k in range(2):
            free(e, tenant, f"{name}{k}", "sample")
    free(e, 3, "huge", "sample", 7)
    release.set()
    settle(e)
    e.stop(5)
    assert ran[1] == ["b0", "a0", "c0", "b1", "a1", "c1"], ran
    assert ["huge"] in ran
    assert all(len(batch) <= 6 for batch in ran)
    assert sorted(op for batch in ran for op in batch) == sorted(
        ["hold", "huge", *(f"b{k}" for k in range(6)), "a0", "a1", "c0", "c1"]
    )


def test_the_models_of_one_tenant_take_turns(tmp_path):
    """One tenant's two models with 3 queued requests each alternate, and a second
    tenant's model, queued last, runs second: neither model's backlog starves the rest."""
    e, ran, started, release = held_engine(tmp_path, "fair")
    m1, m2 = add(e, "m1"), add(e, "m2")
    other = Model("o", 2, "s", status=ModelStatus.READY, next_seq=1)
    e.add_model(other)
    e.start()
    free(e, 9, "hold", "x")
    assert started.wait(10)
    order: list[str] = []

    def op(name: str) -> Op:
        return Op(name, None, run=lambda: order.append(name))

    for seq in (1, 2, 3):
        for m in (m1, m2):
            e.submit(1, m, seq, f"{m.id}.{seq}", lambda n=f"{m.id}.{seq}": op(n))
    e.submit(2, other, 1, "o.1", lambda: op("o.1"))
    release.set()
    settle(e)
    e.stop(5)
    assert order == ["m1.1", "o.1", "m2.1", "m1.2", "m2.2", "m1.3", "m2.3"], order


# ---------------------------------------------------------------- slices of a batch
class Labeled(Rows):
    def __init__(self, kind: str, label: str) -> None:
        super().__init__(kind)
        self.label = label


class Sliced:
    """A batch of ``n`` slices that records each one (and fails at slice ``fail_at``)."""

    def __init__(self, ran: list, ops: list[Op], n: int, fail_at: int = 0) -> None:
        self.ran, self.ops, self.n, self.fail_at, self.k = ran, ops, n, fail_at, 0

    def advance(self) -> bool:
        self.k += 1
        self.ran.append([f"slice{self.k}"])
        if self.k == self.fail_at:
            raise ServiceError("the slice failed.")
        return self.k == self.n

    def results(self) -> list[dict]:
        return [{"label": op.batch.label} for op in self.ops]

    def abandon(self) -> None:
        self.ran.append(["abandoned"])


def sliced_engine(tmp_path, fail_at: int = 0):
    """An engine whose sampling batches run in 3 slices, the first batch held until
    ``release``."""
    import threading

    ran: list[list[str]] = []
    started, release = threading.Event(), threading.Event()

    def run_batch(ops: list[Op]):
        ran.append([o.batch.label for o in ops])
        if ops[0].kind != "sample":
            return [{} for _ in ops]
        started.set()
        release.wait(10)
        return Sliced(ran, ops, 3, fail_at)

    futures = FutureTable(Database(tmp_path / "db.sqlite"), 1000)
    e = Engine(futures, batch_tenants=True, gap_timeout_s=10, run_batch=run_batch)
    return e, ran, started, release


def test_training_requests_run_between_the_slices_of_another_tenants_sampling_batch(tmp_path):
    """While tenant 2's sampling batch runs (its first slice right after its start),
    tenant 1's forward and optim_step each run after one slice of it; tenant 3's save and tenant 2's next sampling request (which
    could change the slots it samples from) wait for its end; it is delivered whole."""
    e, ran, started, release = sliced_engine(tmp_path)
    m = add(e, "m")
    e.start()
    b0 = e.submit(
        2, None, None, "sample", lambda: Op("sample", None, batch=Labeled("sample", "b0"))
    )
    assert started.wait(10)
    e.submit(1, m, 1, "forward", lambda: Op("forward", None, batch=Labeled("forward", "a1")))
    e.submit(1, m, 2, "optim_step", lambda: Op("optim_step", None, run=lambda: ran.append(["a2"])))
    e.submit(3, None, None, "save_weights",
             lambda: Op("save_weights", None, run=lambda: ran.append(["c"])))  # fmt: skip
    e.submit(2, None, None, "sample", lambda: Op("sample", None, batch=Labeled("sample", "b1")))
    release.set()
    settle(e)
    e.stop(5)
    assert ran == [["b0"], ["slice1"], ["a1"], ["slice2"], ["a2"], ["slice3"], ["c"], ["b1"],
                   ["slice1"], ["slice2"], ["slice3"]], ran  # fmt: skip
    assert b0.status == "done" and b0.result == {"label": "b0"}


def test_each_slice_is_a_turn_so_a_request_waiting_through_the_last_one_goes_before_the_next_batch(
    tmp_path,
):
    """Tenant 1's third request waits through the last slice of tenant 2's batch; that
    slice was tenant 2's turn, so tenant 1's request runs before tenant 2's next batch
    (counting only the batch's start as its turn put the next batch first)."""
    e, ran, started, release = sliced_engine(tmp_path)
    m = add(e, "m")
    e.start()
    e.submit(2, None, None, "sample", lambda: Op("sample", None, batch=Labeled("sample", "b0")))
    assert started.wait(10)
    for seq in (1, 2, 3):
        e.submit(1, m, seq, "forward",
                 lambda s=seq: Op("forward", None, batch=Labeled("forward", f"a{s}")))  # fmt: skip
    e.submit(2, None, None, "sample", lambda: Op("sample", None, batch=Labeled("sample", "b1")))
    release.set()
    settle(e)
    e.stop(5)
    assert ran == [["b0"], ["slice1"], ["a1"], ["slice2"], ["a2"], ["slice3"], ["a3"], ["b1"],
                   ["slice1"], ["slice2"], ["slice3"]], ran  # fmt: skip


def test_a_failed_slice_fails_its_batch_and_drops_it_and_the_worker_goes_on(tmp_path):
    e, ran, started, release = sliced_engine(tmp_path, fail_at=2)
    e.start()
    b0 = e.submit(
        2, None, None, "sample", lambda: Op("sample", None, batch=Labeled("sample", "b0"))
    )
    assert started.wait(10)
    e.submit(1, None, None, "forward", lambda: Op("forward", None, batch=Labeled("forward", "a")))
    release.set()
    settle(e)
    e.stop(5)
    assert ran == [["b0"], ["slice1"], ["a"], ["slice2"], ["abandoned"]], ran
    assert b0.status == "failed" and "the slice failed." in b0.error
