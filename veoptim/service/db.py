"""The service's state in one SQLite file (``<run.dir>/service.sqlite``, WAL): every SQL
statement of the service is in this module.

Tables: tenants (name, key hash), sessions, training_runs (one per model: owner, base
model, rank), models (a run's live slot in this server process), futures (status of
every request, so a restart can answer the ones a crash left pending), checkpoints (a
tenant's ``tinker://`` names mapped to slot-store entries), samplers (sampling sessions:
the snapshot each samples, pinned at creation). The status vocabularies of models,
futures and checkpoints are defined here, once.

Every read or write of a tenant's rows takes the tenant (``tenant_id``) and names it in
its ``WHERE`` clause: a caller cannot reach another tenant's sessions, runs, futures,
checkpoints or samplers through this class. The few calls that span tenants are the
server's own (start-up recovery, expiring sessions, the store entries still referenced)
and say so.

Schema versions: ``PRAGMA user_version`` holds the version; :data:`MIGRATIONS` lists, per
version, the statements that bring the previous version to it. Opening applies every
missing migration in one transaction; a file of a newer version than this code knows is
refused (never downgraded). A schema change appends a migration, never edits one.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from veoptim.errors import ConfigError

DB_FILE = "service.sqlite"
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # version 1
        """CREATE TABLE tenants (
            id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, key_hash TEXT NOT NULL UNIQUE,
            created REAL NOT NULL)""",
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
            created REAL NOT NULL, last_heartbeat REAL NOT NULL, finished REAL,
            finish_reason TEXT)""",
        """CREATE TABLE training_runs (
            id TEXT PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
            session_id TEXT NOT NULL, base_model TEXT NOT NULL, lora_rank INTEGER NOT NULL,
            created REAL NOT NULL, last_request REAL NOT NULL, user_metadata TEXT)""",
        """CREATE TABLE models (
            id TEXT PRIMARY KEY REFERENCES training_runs(id), slot INTEGER, status TEXT NOT NULL,
            updated REAL NOT NULL)""",
        """CREATE TABLE futures (
            id TEXT PRIMARY KEY, tenant_id INTEGER NOT NULL, model_id TEXT, kind TEXT NOT NULL,
            status TEXT NOT NULL, category TEXT, error TEXT, created REAL NOT NULL,
            finished REAL)""",
        """CREATE TABLE checkpoints (
            id INTEGER PRIMARY KEY, tenant_id INTEGER NOT NULL, run_id TEXT NOT NULL,
            kind TEXT NOT NULL, name TEXT NOT NULL, store_ref TEXT NOT NULL,
            size_bytes INTEGER NOT NULL, created REAL NOT NULL, UNIQUE (run_id, kind, name))""",
        "CREATE INDEX futures_status ON futures (status)",
        "CREATE INDEX checkpoints_tenant ON checkpoints (tenant_id, run_id)",
    ),
    (  # version 2: sampling sessions (store_ref: the snapshot they sample; NULL: the base)
        """CREATE TABLE samplers (
            id TEXT PRIMARY KEY, tenant_id INTEGER NOT NULL REFERENCES tenants(id),
            session_id TEXT NOT NULL, base_model TEXT NOT NULL, model_path TEXT,
            store_ref TEXT, created REAL NOT NULL)""",
    ),
    (  # version 3: a checkpoint found by its store entry (samplers pin entries)
        "CREATE INDEX checkpoints_store_ref ON checkpoints (store_ref)",
        "CREATE INDEX samplers_session ON samplers (session_id)",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


class ModelStatus(StrEnum):
    """A model (one training client) in this server process, and as the database keeps it."""

    CREATING = "creating"
    READY = "ready"
    UNLOADED = "unloaded"
    LOST = "lost"  # held a slot when the server stopped (models live in memory)


class FutureStatus(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class CheckpointKind(StrEnum):
    TRAINING = "training"  # adapter, optimizer state and schedule
    WEIGHTS_ONLY = "sampler"  # adapter weights only, with a PEFT export (save_weights_for_sampler)
    EXTERNAL = "external"  # a PEFT export alone (save_weights_external): downloaded, never loaded


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str


@dataclass(frozen=True)
class Run:
    """A training run (one model) as a tenant lists it."""

    id: str
    owner: str
    base_model: str
    lora_rank: int
    last_request: float
    user_metadata: Any


@dataclass(frozen=True)
class Checkpoint:
    """A published checkpoint: its ``tinker://`` name and the slot-store entry behind it."""

    run_id: str
    kind: CheckpointKind
    name: str
    store_ref: str
    size_bytes: int
    created: float


@dataclass(frozen=True)
class Sampler:
    id: str
    base_model: str
    model_path: str | None
    #: The store entry it samples (None: the base alone).
    store_ref: str | None
    #: False once the checkpoint it samples was deleted or overwritten.
    live: bool


class Database:
    """One connection shared by the HTTP threads and the worker, serialised by a lock."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ConfigError(
                    f"{self.path} has schema version {version}, newer than this server's "
                    f"{SCHEMA_VERSION}; run a newer veoptim on it."
                )
            if version == SCHEMA_VERSION:
                return
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for statements in MIGRATIONS[version:]:
                    for statement in statements:
                        self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ------------------------------------------------------------------ primitives
    def _run(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._conn.execute(sql, tuple(args))

    def _one(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchone()

    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------ tenants (the server's)
    def add_tenant(self, name: str, key_hash: str) -> None:
        """Add ``name`` with its key hash, or give an existing tenant this key (its old key
        stops working)."""
        self._run(
            "INSERT INTO tenants (name, key_hash, created) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET key_hash = excluded.key_hash",
            (name, key_hash, time.time()),
        )

    def tenant_by_hash(self, key_hash: str) -> Tenant | None:
        row = self._one("SELECT id, name FROM tenants WHERE key_hash = ?", (key_hash,))
        return None if row is None else Tenant(int(row["id"]), str(row["name"]))

    def tenant_keys(self) -> dict[str, Tenant]:
        """Every key hash and its tenant (the server's table of keys)."""
        rows = self._all("SELECT id, name, key_hash FROM tenants")
        return {str(r["key_hash"]): Tenant(int(r["id"]), str(r["name"])) for r in rows}

    def tenant_id(self, name: str) -> int | None:
        row = self._one("SELECT id FROM tenants WHERE name = ?", (name,))
        return None if row is None else int(row["id"])

    def tenant_names(self) -> list[str]:
        return [r["name"] for r in self._all("SELECT name FROM tenants ORDER BY name")]

    # ------------------------------------------------------------------ sessions
    def create_session(self, tenant_id: int, session_id: str) -> None:
        now = time.time()
        self._run(
            "INSERT INTO sessions (id, tenant_id, created, last_heartbeat) VALUES (?, ?, ?, ?)",
            (session_id, tenant_id, now, now),
        )

    def session(self, tenant_id: int, session_id: str) -> sqlite3.Row | None:
        """The tenant's session (``finished``, ``finish_reason``); None: not the tenant's."""
        return self._one(
            "SELECT id, finished, finish_reason FROM sessions WHERE id = ? AND tenant_id = ?",
            (session_id, tenant_id),
        )

    def heartbeat(self, tenant_id: int, session_id: str, when: float) -> None:
        self._run(
            "UPDATE sessions SET last_heartbeat = ? WHERE id = ? AND tenant_id = ?",
            (when, session_id, tenant_id),
        )

    def finish_session(self, tenant_id: int, session_id: str, reason: str) -> None:
        self._run(
            "UPDATE sessions SET finished = ?, finish_reason = ? "
            "WHERE id = ? AND tenant_id = ? AND finished IS NULL",
            (time.time(), reason, session_id, tenant_id),
        )

    def expired_sessions(self, cutoff: float) -> list[tuple[int, str]]:
        """(tenant, session) of every open session without a heartbeat since ``cutoff``
        (the server's housekeeping, over all tenants)."""
        rows = self._all(
            "SELECT tenant_id, id FROM sessions WHERE finished IS NULL AND last_heartbeat < ?",
            (cutoff,),
        )
        return [(int(r["tenant_id"]), str(r["id"])) for r in rows]

    # ------------------------------------------------------------------ training runs, models
    def run_exists(self, tenant_id: int, run_id: str) -> bool:
        row = self._one(
            "SELECT 1 FROM training_runs WHERE id = ? AND tenant_id = ?", (run_id, tenant_id)
        )
        return row is not None

    def record_model(self, tenant_id: int, model_id: str, session_id: str, base_model: str,
                     rank: int, slot: int, metadata: Any) -> None:  # fmt: skip
        """A model created (its training run) and the slot it holds, in one transaction."""
        now = time.time()
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute(
                    "INSERT INTO training_runs (id, tenant_id, session_id, base_model, "
                    "lora_rank, created, last_request, user_metadata) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (model_id, tenant_id, session_id, base_model, rank, now, now,
                     json.dumps(metadata) if metadata else None),
                )  # fmt: skip
                self._conn.execute(
                    "INSERT INTO models (id, slot, status, updated) VALUES (?, ?, ?, ?)",
                    (model_id, slot, ModelStatus.READY, now),
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def unload_model(self, tenant_id: int, model_id: str) -> None:
        self._run(
            "UPDATE models SET slot = NULL, status = ?, updated = ? WHERE id = ? AND id IN "
            "(SELECT id FROM training_runs WHERE tenant_id = ?)",
            (ModelStatus.UNLOADED, time.time(), model_id, tenant_id),
        )

    def model_status(self, tenant_id: int, model_id: str) -> ModelStatus | None:
        """The recorded status of a model of this tenant (None: no such model)."""
        row = self._one(
            "SELECT m.status FROM models m JOIN training_runs r ON r.id = m.id "
            "WHERE m.id = ? AND r.tenant_id = ?",
            (model_id, tenant_id),
        )
        return None if row is None else ModelStatus(row["status"])

    def touch_run(self, tenant_id: int, run_id: str) -> None:
        self._run(
            "UPDATE training_runs SET last_request = ? WHERE id = ? AND tenant_id = ?",
            (time.time(), run_id, tenant_id),
        )

    def run_rank(self, tenant_id: int, run_id: str) -> int:
        """The LoRA rank of the tenant's run (0: unknown)."""
        row = self._one(
            "SELECT lora_rank FROM training_runs WHERE id = ? AND tenant_id = ?",
            (run_id, tenant_id),
        )
        return 0 if row is None else int(row["lora_rank"])

    def run(self, tenant_id: int, run_id: str) -> Run | None:
        row = self._one(
            "SELECT r.*, t.name AS owner FROM training_runs r JOIN tenants t ON t.id = r.tenant_id "
            "WHERE r.id = ? AND r.tenant_id = ?",
            (run_id, tenant_id),
        )
        return None if row is None else _run_of(row)

    def runs(self, tenant_id: int, limit: int, offset: int) -> tuple[list[Run], int]:
        """A page of the tenant's runs, newest first, and how many it has in all."""
        total = self._one(
            "SELECT COUNT(*) AS n FROM training_runs WHERE tenant_id = ?", (tenant_id,)
        )
        rows = self._all(
            "SELECT r.*, t.name AS owner FROM training_runs r JOIN tenants t ON t.id = r.tenant_id "
            "WHERE r.tenant_id = ? ORDER BY r.created DESC LIMIT ? OFFSET ?",
            (tenant_id, limit, offset),
        )
        return [_run_of(r) for r in rows], int(total["n"]) if total else 0

    # ------------------------------------------------------------------ futures
    def add_future(self, tenant_id: int, future_id: str, model_id: str | None, kind: str) -> None:
        self._run(
            "INSERT INTO futures (id, tenant_id, model_id, kind, status, created) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (future_id, tenant_id, model_id, kind, FutureStatus.PENDING, time.time()),
        )

    def finish_future(self, tenant_id: int, future_id: str, status: FutureStatus,
                      category: str, error: str, finished: float) -> None:  # fmt: skip
        self._run(
            "UPDATE futures SET status = ?, category = ?, error = ?, finished = ? "
            "WHERE id = ? AND tenant_id = ?",
            (status, category or None, error or None, finished, future_id, tenant_id),
        )

    def future(self, tenant_id: int, future_id: str) -> sqlite3.Row | None:
        return self._one(
            "SELECT id, model_id, kind, category, error FROM futures WHERE id = ? AND tenant_id = ?",
            (future_id, tenant_id),
        )

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, tenant_id: int, run_id: str, kind: str, name: str) -> Checkpoint | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?",
            (tenant_id, run_id, kind, name),
        )
        return None if row is None else _checkpoint_of(row)

    def checkpoints(self, tenant_id: int, run_id: str) -> list[Checkpoint]:
        rows = self._all(
            "SELECT * FROM checkpoints WHERE run_id = ? AND tenant_id = ? ORDER BY created",
            (run_id, tenant_id),
        )
        return [_checkpoint_of(r) for r in rows]

    def latest_checkpoint(self, tenant_id: int, run_id: str, kind: str) -> Checkpoint | None:
        row = self._one(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND tenant_id = ? "
            "ORDER BY created DESC LIMIT 1",
            (run_id, kind, tenant_id),
        )
        return None if row is None else _checkpoint_of(row)

    def record_checkpoint(self, tenant_id: int, run_id: str, kind: str, name: str,
                          store_ref: str, size_bytes: int) -> None:  # fmt: skip
        """Record a published checkpoint (replacing the record of that name, if any)."""
        self._run(
            "INSERT INTO checkpoints (tenant_id, run_id, kind, name, store_ref, size_bytes, "
            "created) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, kind, name) DO UPDATE "
            "SET store_ref = excluded.store_ref, size_bytes = excluded.size_bytes, "
            "created = excluded.created WHERE checkpoints.tenant_id = excluded.tenant_id",
            (tenant_id, run_id, kind, name, store_ref, size_bytes, time.time()),
        )

    def delete_checkpoint(self, tenant_id: int, run_id: str, kind: str, name: str) -> str | None:
        """Forget the tenant's checkpoint; the store entry it named (None: no such one)."""
        with self._lock:
            found = self.checkpoint(tenant_id, run_id, kind, name)
            if found is None:
                return None
            self._run(
                "DELETE FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? "
                "AND name = ?",
                (tenant_id, run_id, kind, name),
            )
            return found.store_ref

    # ------------------------------------------------------------------ samplers
    def add_sampler(self, tenant_id: int, sampler_id: str, session_id: str, base_model: str,
                    model_path: str | None, store_ref: str | None) -> bool:  # fmt: skip
        """Record a sampling session; True also when the same one exists (the SDK retries a
        create whose answer it lost), False when the id names another."""
        with self._lock:
            old = self._one(
                "SELECT model_path, store_ref FROM samplers WHERE id = ? AND tenant_id = ?",
                (sampler_id, tenant_id),
            )
            if old is not None:
                return (old["model_path"], old["store_ref"]) == (model_path, store_ref)
            self._run(
                "INSERT INTO samplers (id, tenant_id, session_id, base_model, model_path, "
                "store_ref, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (sampler_id, tenant_id, session_id, base_model, model_path, store_ref,
                 time.time()),
            )  # fmt: skip
            return True

    def sampler(self, tenant_id: int, sampler_id: str) -> Sampler | None:
        """The tenant's sampler; ``live`` while the checkpoint it samples is still recorded
        under the entry the sampler pinned."""
        row = self._one(
            "SELECT s.*, (s.store_ref IS NULL OR EXISTS (SELECT 1 FROM checkpoints c WHERE "
            "c.store_ref = s.store_ref AND c.tenant_id = s.tenant_id)) AS live "
            "FROM samplers s WHERE s.id = ? AND s.tenant_id = ?",
            (sampler_id, tenant_id),
        )
        if row is None:
            return None
        return Sampler(str(row["id"]), str(row["base_model"]), row["model_path"],
                       row["store_ref"], bool(row["live"]))  # fmt: skip

    def session_has_samplers(self, tenant_id: int, session_id: str) -> bool:
        row = self._one(
            "SELECT 1 FROM samplers WHERE session_id = ? AND tenant_id = ?",
            (session_id, tenant_id),
        )
        return row is not None

    def sampled_store_refs(self) -> set[str]:
        """The store entries a sampler of an open session samples (the server's slot
        housekeeping, over all tenants)."""
        rows = self._all(
            "SELECT s.store_ref FROM samplers s JOIN sessions x ON x.id = s.session_id "
            "WHERE x.finished IS NULL AND s.store_ref IS NOT NULL"
        )
        return {str(r["store_ref"]) for r in rows}

    # ------------------------------------------------------------------ restart (the server's)
    def recover(self, message: str) -> int:
        """After a restart: every pending future fails (server), no model holds a slot.
        Returns how many futures were pending."""
        now = time.time()
        with self._lock:
            cursor = self._run(
                "UPDATE futures SET status = ?, category = 'server', error = ?, finished = ? "
                "WHERE status = ?",
                (FutureStatus.FAILED, message, now, FutureStatus.PENDING),
            )
            self._run(
                "UPDATE models SET slot = NULL, status = ?, updated = ? WHERE slot IS NOT NULL",
                (ModelStatus.LOST, now),
            )
            return cursor.rowcount

    def recorded_store_refs(self) -> set[str]:
        """Every store entry a checkpoint record names: what start-up keeps of the store (a
        sampler of a deleted or overwritten checkpoint has ended)."""
        return {str(r["store_ref"]) for r in self._all("SELECT store_ref FROM checkpoints")}


def _run_of(row: sqlite3.Row) -> Run:
    metadata = json.loads(row["user_metadata"]) if row["user_metadata"] else None
    return Run(str(row["id"]), str(row["owner"]), str(row["base_model"]), int(row["lora_rank"]),
               float(row["last_request"]), metadata)  # fmt: skip


def _checkpoint_of(row: sqlite3.Row) -> Checkpoint:
    return Checkpoint(str(row["run_id"]), CheckpointKind(row["kind"]), str(row["name"]),
                      str(row["store_ref"]), int(row["size_bytes"]), float(row["created"]))  # fmt: skip
