"""The service's state in one SQLite file (``<run.dir>/service.sqlite``, WAL).

Tables: tenants (name, key hash), sessions, training_runs (one per model: owner, base
model, rank), models (a run's live slot in this server process), futures (status of
every request, so a restart can answer the ones a crash left pending), checkpoints (a
tenant's ``tinker://`` names mapped to slot-store references), samplers (sampling
sessions: the snapshot each samples, pinned at creation).

Schema versions: ``PRAGMA user_version`` holds the version; :data:`MIGRATIONS` lists, per
version, the statements that bring the previous version to it. Opening applies every
missing migration in one transaction; a file of a newer version than this code knows is
refused (never downgraded). A schema change appends a migration, never edits one.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterable
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
)
SCHEMA_VERSION = len(MIGRATIONS)
PENDING, DONE, FAILED = "pending", "done", "failed"
#: The status of a model that held a slot when the server stopped (models live in memory).
LOST = "lost"


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
    def execute(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._conn.execute(sql, tuple(args))

    def one(self, sql: str, args: Iterable[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchone()

    def all(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------ tenants
    def add_tenant(self, name: str, key_hash: str) -> None:
        """Add ``name`` with its key hash, or give an existing tenant this key."""
        self.execute(
            "INSERT INTO tenants (name, key_hash, created) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET key_hash = excluded.key_hash",
            (name, key_hash, time.time()),
        )

    def tenant_by_hash(self, key_hash: str) -> sqlite3.Row | None:
        return self.one("SELECT * FROM tenants WHERE key_hash = ?", (key_hash,))

    def model_status(self, model_id: str, tenant_id: int) -> str | None:
        """The recorded status of a model of this tenant (None: no such model)."""
        row = self.one(
            "SELECT m.status FROM models m JOIN training_runs r ON r.id = m.id "
            "WHERE m.id = ? AND r.tenant_id = ?",
            (model_id, tenant_id),
        )
        return None if row is None else str(row["status"])

    def tenant_names(self) -> list[str]:
        return [r["name"] for r in self.all("SELECT name FROM tenants ORDER BY name")]

    # ------------------------------------------------------------------ restart
    def recover(self, message: str) -> int:
        """After a restart: every pending future fails (server), no model holds a slot."""
        now = time.time()
        with self._lock:
            cursor = self.execute(
                "UPDATE futures SET status = ?, category = 'server', error = ?, finished = ? "
                "WHERE status = ?",
                (FAILED, message, now, PENDING),
            )
            self.execute(
                "UPDATE models SET slot = NULL, status = ?, updated = ? WHERE slot IS NOT NULL",
                (LOST, now),
            )
            return cursor.rowcount
