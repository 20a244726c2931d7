"""API keys and tenants. A key is ``tml-`` + 40 random URL-safe characters; only its
SHA-256 is stored (a key has 240 bits of entropy, so a plain hash is enough) and no key
is ever logged. Keys come from ``serve.keys_file`` ('NAME KEY' per line) or
``veoptim-serve keys add NAME``."""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from veoptim.errors import ConfigError
from veoptim.service.db import Tenant

PREFIX = "tml-"
HEADER = "X-API-Key"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(30)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise ConfigError(
            f"a tenant name is letters, digits, '.', '_' and '-' (at most 64), got {name!r}."
        )
    return name


def read_keys_file(path: str | Path) -> list[tuple[str, str]]:
    """(tenant name, key hash) per line of ``path``; errors name the line, never the key."""
    out = []
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"serve.keys_file {path} cannot be read: {exc.strerror}.") from exc
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2 or not parts[1].startswith(PREFIX) or len(parts[1]) < 20:
            raise ConfigError(
                f"serve.keys_file {path} line {number}: expected 'NAME tml-KEY' (a key of at "
                f"least 20 characters starting with {PREFIX!r})."
            )
        out.append((check_tenant_name(parts[0]), key_hash(parts[1])))
    return out


class KeyTable:
    """The server's API keys in memory (key hash -> tenant), so that a request's tenant is
    found without a database read on the event loop. The table is read again every second
    off the loop (:meth:`refresh`, housekeeping); a key it does not hold is looked up in the
    database (:meth:`lookup_stored`, off the loop), so a tenant added while the server runs
    gets in at once. A replaced key (``keys add`` for an existing tenant) is refused from
    the next refresh, or at once once the new key was used."""

    def __init__(self, load: Callable[[], dict[str, Tenant]],
                 find: Callable[[str], Tenant | None]) -> None:  # fmt: skip
        self._load, self._find = load, find
        self._table: dict[str, Tenant] = {}
        self._lock = threading.Lock()
        self.refresh()

    def get(self, key: str) -> Tenant | None:
        """The tenant of ``key`` if the table holds it (no I/O)."""
        return self._table.get(key_hash(key))

    def lookup_stored(self, key: str) -> Tenant | None:
        """The tenant of ``key`` as the database knows it (blocking), noted in the table."""
        digest = key_hash(key)
        tenant = self._find(digest)
        if tenant is not None:
            with self._lock:
                table = {h: t for h, t in self._table.items() if t.id != tenant.id}
                table[digest] = tenant
                self._table = table
        return tenant

    def refresh(self) -> None:
        """Read every key again (blocking)."""
        table = self._load()
        with self._lock:
            self._table = table
