"""API keys and tenants. A key is ``tml-`` + 40 random URL-safe characters; only its
SHA-256 is stored (a key has 240 bits of entropy, so a plain hash is enough) and no key
is ever logged. Keys come from ``serve.keys_file`` ('NAME KEY' per line) or
``veoptim-serve keys add NAME``."""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

from veoptim.errors import ConfigError

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
