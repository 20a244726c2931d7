"""Client sessions: created by ``create_session``, kept alive by heartbeats, finished by
the SDK's ``close()`` or after ``serve.session_timeout_s`` without a heartbeat. A
finished session's models free their slots, and so do the snapshot slots only its
samplers sampled; its training runs and checkpoints stay.

The open sessions this process has seen are also held in memory, so that a heartbeat
(every 10 s per client) is answered without I/O on the event loop; the heartbeat times
reach the database with the next housekeeping round (every second), before sessions
are expired from it."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from veoptim.service.backend import Backend
from veoptim.service.db import Database, ModelStatus
from veoptim.service.engine import Engine, Op
from veoptim.service.errors import Gone, NotFound
from veoptim.service.futures import Future
from veoptim.service.sampling import Samplers

log = logging.getLogger("veoptim.service")


class Sessions:
    def __init__(self, database: Database, engine: Engine, backend: Backend,
                 samplers: Samplers) -> None:  # fmt: skip
        self.db, self.engine, self.backend, self.samplers = database, engine, backend, samplers
        self._lock = threading.Lock()
        #: open session -> its tenant; and the heartbeats not yet written.
        self._open: dict[str, int] = {}
        self._beats: dict[str, float] = {}

    def create(self, tenant_id: int) -> str:
        self.engine.check_open()
        session_id = uuid.uuid4().hex[:16]
        self.db.create_session(tenant_id, session_id)
        with self._lock:
            self._open[session_id] = tenant_id
        return session_id

    def check(self, tenant_id: int, session_id: str, field: str = "session_id") -> str:
        """``session_id`` if it is an open session of the tenant (refused naming ``field``)."""
        with self._lock:
            if self._open.get(session_id) == tenant_id:
                return session_id
        row = self.db.session(tenant_id, session_id)
        if row is None:
            raise NotFound(f"{field} {session_id!r} is not a session of this tenant.")
        if row["finished"] is not None:
            raise Gone(f"{field} {session_id!r} is finished ({row['finish_reason']}).")
        with self._lock:
            self._open[session_id] = tenant_id
        return session_id

    def beat_in_memory(self, tenant_id: int, session_id: str) -> bool:
        """Note a heartbeat of an open session held in memory (no I/O); False: not held,
        :meth:`heartbeat` decides."""
        with self._lock:
            if self._open.get(session_id) != tenant_id:
                return False
            self._beats[session_id] = time.time()
            return True

    def heartbeat(self, tenant_id: int, session_id: str) -> None:
        self.check(tenant_id, session_id)
        self.beat_in_memory(tenant_id, session_id)

    def write_heartbeats(self) -> None:
        """Write the heartbeats noted in memory (housekeeping)."""
        with self._lock:
            beats, self._beats = self._beats, {}
            owners = {sid: self._open.get(sid) for sid in beats}
        for session_id, when in beats.items():
            if owners[session_id] is not None:
                self.db.heartbeat(owners[session_id], session_id, when)

    def finish(self, tenant_id: int, session_id: str, reason: str) -> list[Future]:
        """Mark the tenant's session finished and queue the release of its slots; the
        futures of those releases."""
        if self.db.session(tenant_id, session_id) is None:
            raise NotFound(f"session {session_id!r} is not a session of this tenant.")
        with self._lock:
            self._open.pop(session_id, None)
            self._beats.pop(session_id, None)
        self.db.finish_session(tenant_id, session_id, reason)
        models = [
            m
            for m in list(self.engine.models.values())
            if m.session_id == session_id
            and m.tenant_id == tenant_id
            and m.status != ModelStatus.UNLOADED
        ]
        releases = [self._on_worker(tenant_id, "unload_model", lambda m=m: self.backend.release(m))
                    for m in models]  # fmt: skip
        if self.db.session_has_samplers(tenant_id, session_id):
            releases.append(
                self._on_worker(tenant_id, "release_samplers", self.samplers.release_unused)
            )
        return releases

    def expire(self, timeout_s: float, now: float) -> None:
        """Finish every session without a heartbeat for ``timeout_s`` (housekeeping)."""
        self.write_heartbeats()
        for tenant_id, session_id in self.db.expired_sessions(now - timeout_s):
            log.info("session %s sent no heartbeat for %g s: finished", session_id, timeout_s)
            try:
                self.finish(tenant_id, session_id, "expired")
            except Exception:  # shutting down
                log.debug("could not expire session %s", session_id, exc_info=True)

    def _on_worker(self, tenant_id: int, kind: str, action: Any) -> Future:
        def run() -> dict[str, str]:
            action()
            return {"type": kind}

        return self.engine.submit(tenant_id, None, None, kind, lambda: Op(kind, None, run=run))
