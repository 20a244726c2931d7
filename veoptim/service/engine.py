"""The worker: one thread runs every request that touches the trainer, each model's in
its ``seq_id`` order.

A model's requests carry consecutive ``seq_id`` s (the SDK numbers them from 1; the call
that creates the model, ``create_model`` or a create-by-load, is 0). One that arrives
before its predecessors waits (the SDK sends a split batch concurrently, first chunk
last); one that waits longer than ``serve.seq_gap_timeout_s`` fails. A ``seq_id`` already
used is refused at submit (unless it is a retry: the same ``X-Idempotency-Key``). A
request refused at submit for bad input still uses its ``seq_id`` (the SDK has moved
on), so the model's next request does not wait for it.

With ``serve.batch_tenants`` the worker runs the ``forward_backward`` and ``forward``
requests of one loss at the head of several models' queues as one slot batch
(:meth:`Backend.forward_backward`; a forward trains nothing), and the waiting ``asample``
requests (outside any model's order) as one sampling batch. :meth:`Engine.submit`
validates a request outside the engine's lock, its ``seq_id`` reserved meanwhile.

Which request runs next is the scheduler's choice (``serve.schedule``). ``fair`` (the
default) takes turns: the next batch starts with the runnable request of the tenant served
longest ago (then of that tenant's model, or its unordered requests, served longest ago),
and the requests that join it are taken one per tenant in the same order, then a second
per tenant, and so on, while the batch holds at most ``serve.max_batch_rows`` rows (datums
or samples; a single larger request runs alone). A tenant's small request therefore waits
for at most the batch that is running when it arrives, whatever another tenant has queued.
``fifo`` runs the earliest-arrived request first (the order before fairness; kept for
comparisons).

A sampling batch runs a slice at a time (:class:`Slices`: about ``serve.slice_s`` seconds
of decode steps): between two of its slices the worker runs one batch of the training
requests (``forward``, ``forward_backward``, ``optim_step``) that are runnable, in the
schedule's order. A tenant's training request therefore waits for one slice of another
tenant's sampling, not for the whole generation. Other requests (sampling, saves, loads,
model creation) wait for the batch to end: they could change the slots it samples from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from veoptim.service.config import SCHEDULES
from veoptim.service.db import ModelStatus
from veoptim.service.errors import SERVER, USER, NotFound, ServiceError, Unavailable, describe
from veoptim.service.futures import Future, FutureTable

log = logging.getLogger("veoptim.service")
#: A request may run at most this many seq_ids ahead of its model's next one.
MAX_AHEAD = 4096
#: How long a retried submission waits for the first one's validation to end.
RETRY_WAIT_S = 30.0
DRAINING = (
    "the server is draining (it received SIGTERM) and accepts no new work; try another "
    "server or later."
)

#: The requests that may run between two slices of a batch in progress: they change no
#: slot but their own model's (a sampling batch samples from snapshots or the base).
BETWEEN_SLICES = frozenset({"forward", "forward_backward", "optim_step"})


class Slices(Protocol):
    """A batch that runs a slice at a time (a sampling batch's decode steps)."""

    def advance(self) -> bool:
        """Run the next slice; whether the batch has ended."""

    def results(self) -> list[Any]:
        """Each request's result (or the exception that failed it alone), once ended."""

    def abandon(self) -> None:
        """Drop what the batch holds (it failed or the server stops)."""


@dataclass
class Op:
    kind: str
    future: Future | None  # None: a refused request that only uses up its seq_id
    run: Callable[[], Any] | None = None
    #: forward_backward: the prepared batch part (Backend.forward_backward runs lists of them).
    batch: Any = None
    arrival: float = field(default_factory=time.monotonic)
    tenant_id: int = -1  # set by Engine.submit

    @property
    def rows(self) -> int:
        """The rows this request adds to a batch (a batch part's ``rows``; otherwise 1)."""
        return int(getattr(self.batch, "rows", 1))


@dataclass
class Head:
    """A request the worker may run now, and the queue it heads: a model's (``model``) or
    its tenant's requests outside any order (``model`` None)."""

    op: Op
    model: Model | None

    @property
    def queue(self) -> tuple[int, str]:
        return (self.op.tenant_id, self.model.id if self.model is not None else "")


@dataclass
class Model:
    """A training client's model in this server process: its status and request order
    (which slot it holds is :class:`~veoptim.service.slots.Slots`' business)."""

    id: str
    tenant_id: int
    session_id: str
    status: ModelStatus = ModelStatus.CREATING
    rank: int = 0
    next_seq: int = 0
    queue: dict[int, Op] = field(default_factory=dict)
    #: seq_id -> (idempotency key, future) of the recent submissions (for retries).
    seen: dict[int, tuple[str, Future | None]] = field(default_factory=dict)
    #: seq_id -> idempotency key of the submissions being validated right now.
    reserved: dict[int, str] = field(default_factory=dict)
    error: str = ""


class Engine:
    def __init__(self, futures: FutureTable, *, batch_tenants: bool, gap_timeout_s: float,
                 run_batch: Callable[[list[Op]], list[Any] | Slices], schedule: str = "fair",
                 max_batch_rows: int = 64) -> None:  # fmt: skip
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.futures, self.batch_tenants, self.gap_timeout_s = futures, batch_tenants, gap_timeout_s
        self.schedule, self.max_batch_rows = schedule, max_batch_rows
        self._run_batch = run_batch
        self.models: dict[str, Model] = {}
        self._free: list[Op] = []  # requests outside any model's order, in arrival order
        #: The batch count when a tenant (int) or a queue ((tenant, model id)) was last served.
        self._served: dict[Any, int] = {}
        self._batches = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._deadline = float("inf")
        self._busy = False
        #: The batch in progress between its slices, and the queue heads it took.
        self._slicing: tuple[list[Head], Slices] | None = None
        self._thread = threading.Thread(target=self._loop, name="veoptim-service-worker")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ models
    def model(self, model_id: str, tenant_id: int) -> Model:
        model = self.models.get(model_id)
        if model is None or model.tenant_id != tenant_id:
            raise NotFound(f"model_id {model_id!r} is not a model of this tenant on this server.")
        return model

    def add_model(self, model: Model) -> None:
        with self._cond:
            self.check_open()
            if model.id in self.models:
                raise ServiceError(
                    f"model_seq_id: model {model.id} already exists in this session."
                )
            self.models[model.id] = model

    def drop_model(self, model: Model, error: str) -> None:
        """Forget a model whose creation failed: it leaves nothing behind; a request that
        already waits in its order fails with the creation's error."""
        with self._cond:
            if self.models.get(model.id) is model:
                del self.models[model.id]
                self._served.pop((model.tenant_id, model.id), None)
            waiting = [op for op in model.queue.values() if op.future is not None]
            model.queue.clear()
        for op in waiting:
            self.futures.fail(op.future, error, USER)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ submit
    def check_open(self) -> None:
        if self._stopping:
            raise Unavailable(DRAINING)

    def submit(self, tenant_id: int, model: Model | None, seq_id: int | None, kind: str,
               prepare: Callable[[], Op], idempotency_key: str = "") -> Future:  # fmt: skip
        """Validate (``prepare`` builds the op; its ServiceError refuses the request) and
        queue a request of ``model`` at ``seq_id`` (None: in arrival order). Validation
        runs outside the engine's lock; a model's ``seq_id`` is reserved meanwhile."""
        if model is None or seq_id is None:
            self.check_open()
            op = prepare()
            op.tenant_id = tenant_id
            op.future = self.futures.create(tenant_id, model.id if model else None, kind)
            with self._cond:
                self._free.append(op)
                self._cond.notify_all()
            return op.future
        with self._cond:
            self.check_open()
            retried = self._reserve(model, seq_id, idempotency_key)
            if retried is not None:
                return retried
            runnable = seq_id == model.next_seq
        op = Op(kind, None, tenant_id=tenant_id)
        try:
            op = prepare()
            op.tenant_id = tenant_id
            op.future = self.futures.create(tenant_id, model.id, kind, limited=not runnable)
        finally:  # a refused request still uses its seq_id: the next one does not wait
            with self._cond:
                model.reserved.pop(seq_id, None)
                self._enqueue(model, seq_id, op, idempotency_key)
                dropped = self.models.get(model.id) is not model
                if dropped:  # its creation failed meanwhile: nothing would run it
                    model.queue.pop(seq_id, None)
                self._cond.notify_all()
        if dropped:
            self.futures.fail(op.future, f"model_id {model.id} could not be created.", USER)  # type: ignore[arg-type]
        return op.future

    def refused(self, tenant_id: int, model_id: str, seq_id: int, kind: str) -> None:
        """Record ``seq_id`` of the tenant's model as used by a request refused before it
        reached :meth:`submit` (its body did not validate); anything else is ignored."""
        with self._cond:
            model = self.models.get(model_id)
            if model is None or model.tenant_id != tenant_id:
                return
            try:
                if self._reserve(model, seq_id, "") is not None:
                    return
            except ServiceError:
                return
            model.reserved.pop(seq_id, None)
            self._enqueue(model, seq_id, Op(kind, None, tenant_id=tenant_id), "")
            self._cond.notify_all()

    def _reserve(self, model: Model, seq_id: int, key: str) -> Future | None:
        """Under the lock: refuse a used or out-of-order ``seq_id``, or reserve it; the
        future of a retried submission (the same idempotency key)."""
        if model.status == ModelStatus.UNLOADED:
            reason = f": {model.error}" if model.error else "."
            raise ServiceError(f"model_id {model.id} is {model.status}{reason}")
        deadline = time.monotonic() + RETRY_WAIT_S
        while key and model.reserved.get(seq_id) == key and time.monotonic() < deadline:
            self._cond.wait(0.05)  # the first submission is being validated
        if seq_id in model.seen:
            seen_key, future = model.seen[seq_id]
            if key and seen_key == key and future is not None:
                return future
        if seq_id in model.seen or seq_id in model.reserved:
            raise ServiceError(
                f"seq_id {seq_id} was already used for model {model.id} (the next one is "
                f"{max([*model.seen, *model.reserved]) + 1}); send each request once, in order."
            )
        if seq_id < model.next_seq or seq_id > model.next_seq + MAX_AHEAD:
            raise ServiceError(
                f"seq_id {seq_id} is out of order for model {model.id}: expected "
                f"{model.next_seq} to {model.next_seq + MAX_AHEAD}."
            )
        model.reserved[seq_id] = key
        return None

    def _enqueue(self, model: Model, seq_id: int, op: Op, key: str) -> None:
        model.queue[seq_id] = op
        model.seen[seq_id] = (key, op.future)
        if len(model.seen) > 4 * MAX_AHEAD:  # pruned in bulk: a submit stays O(1) on average
            for old in [s for s in model.seen if s < seq_id - 2 * MAX_AHEAD]:
                del model.seen[old]

    # ------------------------------------------------------------------ worker
    def _take(self) -> list[Head]:
        """The next ops to run (under the lock): the first runnable op in the schedule's
        order, plus, for a batchable one, the runnable ops that join it (heads of other
        models' queues, unordered requests), in the same order, within the row bound.
        While a batch is in progress, only ops that may run between its slices."""
        candidates = self._runnable()
        if self._slicing is not None:
            candidates = [h for h in candidates if h.op.kind in BETWEEN_SLICES]
        if not candidates:
            return []
        first = candidates[0]
        chosen, rows = [first], first.op.rows
        if first.op.batch is not None and self.batch_tenants:
            for head in candidates[1:]:
                joins = head.op.batch is not None and first.op.batch.joins(head.op.batch)
                if joins and rows + head.op.rows <= self.max_batch_rows:
                    chosen.append(head)
                    rows += head.op.rows
        self._count_turn(chosen)
        for head in chosen:
            if head.model is None:
                self._free.remove(head.op)
            else:
                del head.model.queue[head.model.next_seq]
                head.model.next_seq += 1
        return chosen

    def _count_turn(self, heads: list[Head]) -> None:
        """Their tenants and queues were served now: each batch, and each slice of a batch
        in progress, is one turn, so a tenant whose request waited through a slice goes
        before the next batch of the tenants in that slice."""
        self._batches += 1
        for head in heads:
            self._served[head.op.tenant_id] = self._served[head.queue] = self._batches

    def _runnable(self) -> list[Head]:
        """Every op that may run now, in the schedule's order: ``fifo`` by arrival;
        ``fair`` the first of each tenant (the tenant served longest ago first), then the
        second of each, and so on; a tenant's own in the order its queues (each model, its
        unordered requests) were last served, then by arrival."""
        now = time.monotonic()
        heads = [Head(op, None) for op in self._free]
        for model in self.models.values():
            while model.next_seq in model.queue and model.queue[model.next_seq].future is None:
                del model.queue[model.next_seq]  # a refused request: its seq_id is used up
                model.next_seq += 1
            if not model.queue:
                continue
            head = model.queue.get(model.next_seq)
            if head is not None:
                heads.append(Head(head, model))
            elif now - min(op.arrival for op in model.queue.values()) > self.gap_timeout_s:
                self._fail_gap(model)
        if self.schedule == "fifo":
            return sorted(heads, key=lambda h: h.op.arrival)
        by_tenant: dict[int, list[Head]] = {}
        for head in heads:
            by_tenant.setdefault(head.op.tenant_id, []).append(head)
        ranked = []
        for tenant, own in by_tenant.items():
            own.sort(key=lambda h: (self._served.get(h.queue, -1), h.op.arrival))
            ranked += [((nth, self._served.get(tenant, -1), h.op.arrival), h)
                       for nth, h in enumerate(own)]  # fmt: skip
        ranked.sort(key=lambda r: r[0])
        return [r[-1] for r in ranked]

    def _fail_gap(self, model: Model) -> None:
        missing = model.next_seq
        for seq in sorted(model.queue):
            op = model.queue.pop(seq)
            if op.future is not None:
                self.futures.fail(
                    op.future,
                    f"seq_id {seq} of model {model.id} waited more than {self.gap_timeout_s:g} s "
                    f"for seq_id {missing}, which never arrived (serve.seq_gap_timeout_s).",
                    USER,
                )
            model.next_seq = seq + 1

    def run(self) -> None:
        """The worker loop on the calling thread (the server's main thread: torch runs best
        on the thread that built the model); returns once :meth:`request_stop` drained."""
        self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                heads = self._take() if not self._past_deadline() else []
                while not heads and self._slicing is None:
                    if self._stopping:
                        return
                    self._cond.wait(0.25)
                    heads = self._take()
                self._busy = True
            sliced = None
            try:
                if heads:
                    self._execute(heads)  # may start a batch of slices: its first one follows
                sliced = self._slicing
                if sliced is not None:
                    self._next_slice()
            finally:
                with self._cond:
                    if sliced is not None:
                        self._count_turn(sliced[0])
                    self._busy = False
                    self._cond.notify_all()

    def _execute(self, heads: list[Head]) -> None:
        ops = [head.op for head in heads]
        try:
            if ops[0].batch is not None:
                results = self._run_batch(ops)
            else:
                results = [ops[0].run()]  # type: ignore[misc]
        except Exception as exc:
            self._fail_all(ops, exc)
            return
        if isinstance(results, list):
            self._deliver(ops, results)
        else:
            self._slicing = (heads, results)

    def _next_slice(self) -> None:
        """The batch in progress: its next slice, and its results once it ended (or it is
        abandoned, its requests failed, once the drain's deadline passed)."""
        heads, slices = self._slicing  # type: ignore[misc]
        ops = [head.op for head in heads]
        try:
            if self._past_deadline():
                raise ServiceError("the server shut down before this request finished.",
                                   category=SERVER)  # fmt: skip
            if not slices.advance():
                return
            results = slices.results()
        except Exception as exc:
            self._slicing = None
            try:
                slices.abandon()
            except Exception:
                log.warning("could not drop the abandoned %s batch", ops[0].kind, exc_info=True)
            self._fail_all(ops, exc)
            return
        self._slicing = None
        self._deliver(ops, results)

    def _fail_all(self, ops: list[Op], exc: Exception) -> None:
        """Every request of the batch fails alike."""
        message, category = describe(exc)
        if category == SERVER:
            log.exception("%s failed", ops[0].kind)
        for op in ops:
            self.futures.fail(op.future, message, category)  # type: ignore[arg-type]

    def _deliver(self, ops: list[Op], results: list[Any]) -> None:
        for op, result in zip(ops, results, strict=True):
            if isinstance(result, Exception):
                self.futures.fail(op.future, *describe(result))  # type: ignore[arg-type]
            else:
                self.futures.finish(op.future, result)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ shutdown
    @property
    def stopping(self) -> bool:
        return self._stopping

    def request_stop(self, timeout: float) -> None:
        """Refuse new requests; the worker runs what is runnable for up to ``timeout``
        seconds, then ends. Takes no lock: safe in a signal handler."""
        self._deadline = time.monotonic() + timeout
        self._stopping = True

    def _past_deadline(self) -> bool:
        return self._stopping and time.monotonic() > self._deadline

    def stop(self, timeout: float) -> None:
        """:meth:`request_stop`, wait for the worker thread (if started), then fail every
        request that did not run (server)."""
        if not self._stopping:
            self.request_stop(timeout)
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        with self._cond:
            leftover = list(self._free)
            self._free.clear()
            for model in self.models.values():
                leftover += [op for op in model.queue.values() if op.future is not None]
                model.queue.clear()
        for op in leftover:
            self.futures.fail(op.future, "the server shut down before this request ran.", SERVER)  # type: ignore[arg-type]
        for future in self.futures.pending():
            self.futures.fail(future, "the server shut down before this request finished.", SERVER)

    def idle(self) -> bool:
        with self._cond:
            return (
                not self._busy
                and self._slicing is None
                and not self._free
                and not any(m.queue for m in self.models.values())
            )
