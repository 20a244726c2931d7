"""Request futures: every mutating call answers ``{request_id}`` at once and its result is
fetched by ``retrieve_future`` (a long poll). Results live in memory (a restart loses
them); the status of every future is also in the database, so after a crash the ones
left pending answer a ``server`` error instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from veoptim.service.db import Database, FutureStatus
from veoptim.service.errors import SERVER, NotFound, Redactor, ServiceError

#: A finished result is kept this long after it was first retrieved, and at most
#: RESULT_TTL_S after it finished (a client may poll again after a lost reply).
RETRIEVED_TTL_S, RESULT_TTL_S = 120.0, 3600.0


@dataclass
class Future:
    id: str
    tenant_id: int
    model_id: str | None
    kind: str
    status: FutureStatus = FutureStatus.PENDING
    #: protobuf bytes (forward_backward) or a JSON-able dict.
    result: bytes | dict[str, Any] | None = None
    error: str = ""
    category: str = ""
    finished_at: float = 0.0
    retrieved_at: float = 0.0
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)


def queued(future: Future, model_id: str | None = None) -> dict[str, Any]:
    """The immediate answer of a queued request: the future to retrieve."""
    return {"request_id": future.id, "model_id": model_id or future.model_id}


class FutureTable:
    """The futures of one server. Every failure message passes ``redact`` on its way in,
    so what a tenant reads of a failed request never names a server path or store entry."""

    def __init__(self, database: Database, max_pending_per_tenant: int,
                 redact: Redactor | None = None) -> None:  # fmt: skip
        self.db, self.max_pending = database, max_pending_per_tenant
        self.redact = redact or Redactor(())
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._pending: Counter[int] = Counter()  # tenant id -> its pending futures

    def create(self, tenant_id: int, model_id: str | None, kind: str, *,
               limited: bool = True) -> Future:  # fmt: skip
        """A new pending future; past the tenant's limit refused, unless not ``limited``
        (a model's next request: it can run at once and unblocks the ones waiting on it)."""
        with self._lock:
            pending = self._pending[tenant_id]
            if limited and pending >= self.max_pending:
                raise ServiceError(
                    f"this tenant already has {pending} unfinished requests, the limit "
                    "(serve.max_futures_per_tenant); retrieve their results first."
                )
            future = Future(uuid.uuid4().hex, tenant_id, model_id, kind)
            self._futures[future.id] = future
            self._pending[tenant_id] += 1
        self.db.add_future(tenant_id, future.id, model_id, kind)
        return future

    def finish(self, future: Future, result: bytes | dict[str, Any]) -> None:
        self._complete(future, FutureStatus.DONE, result=result)

    def fail(self, future: Future, message: str, category: str) -> None:
        self._complete(future, FutureStatus.FAILED, error=self.redact(message), category=category)

    def _complete(self, future: Future, status: FutureStatus, **values: Any) -> None:
        with self._lock:
            if future.status != FutureStatus.PENDING:
                return
            for key, value in values.items():
                setattr(future, key, value)
            future.status, future.finished_at = status, time.time()
            self._pending[future.tenant_id] -= 1
            waiters, future.waiters = future.waiters, []
        self.db.finish_future(future.tenant_id, future.id, status, future.category, future.error,
                              future.finished_at)  # fmt: skip
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    def in_memory(self, request_id: str, tenant_id: int) -> Future | None:
        """The tenant's future ``request_id`` if this process holds it (no I/O)."""
        with self._lock:
            future = self._futures.get(request_id)
        return future if future is not None and future.tenant_id == tenant_id else None

    def lookup(self, request_id: str, tenant_id: int) -> Future:
        """The tenant's future ``request_id``: in memory, else as the database knows it (a
        future of an earlier server process)."""
        future = self.in_memory(request_id, tenant_id)
        if future is not None:
            return future
        row = self.db.future(tenant_id, request_id)
        if row is None:
            raise NotFound(f"request_id {request_id!r} is not a request of this tenant.")
        old = Future(row["id"], tenant_id, row["model_id"], row["kind"], status=FutureStatus.FAILED)
        old.category = row["category"] or SERVER
        old.error = row["error"] or (
            "the server restarted after this request finished; its result was not kept."
        )
        return old

    async def wait(self, future: Future, timeout: float) -> None:
        """Return when ``future`` finished or after ``timeout`` seconds."""
        event = asyncio.Event()
        with self._lock:
            if future.status != FutureStatus.PENDING:
                return
            entry = (asyncio.get_running_loop(), event)
            future.waiters.append(entry)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if entry in future.waiters:
                    future.waiters.remove(entry)

    def retrieved(self, future: Future) -> None:
        if not future.retrieved_at:
            future.retrieved_at = time.time()

    def pending(self) -> list[Future]:
        with self._lock:
            return [f for f in self._futures.values() if f.status == FutureStatus.PENDING]

    def sweep(self, now: float | None = None) -> None:
        """Forget finished results past their retention."""
        now = time.time() if now is None else now
        with self._lock:
            for fid in [
                fid
                for fid, f in self._futures.items()
                if f.status != FutureStatus.PENDING
                and (
                    (f.retrieved_at and now - f.retrieved_at > RETRIEVED_TTL_S)
                    or now - f.finished_at > RESULT_TTL_S
                )
            ]:
                del self._futures[fid]
