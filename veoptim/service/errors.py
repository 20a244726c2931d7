"""What a client is told: one sentence, an HTTP status and the SDK's error category; and
what it is never told (the server's paths, its slot-store entry names)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from veoptim.errors import VeoptimError

USER, SERVER = "user", "server"
#: A slot-store entry name as the service makes them (``paths.new_store_ref``).
STORE_REF = re.compile(r"\bc[0-9a-f]{20}\b")


class ServiceError(Exception):
    """A refused or failed request. ``status`` is the HTTP answer when refused at submit;
    ``category`` (``user`` / ``server``) the category when a future fails."""

    def __init__(self, message: str, status: int = 400, category: str = USER) -> None:
        super().__init__(message)
        self.message, self.status, self.category = message, status, category


class NotFound(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=404)


class Unauthorized(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=401)


class TooLarge(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=413)


class Gone(ServiceError):
    """A session that finished (closed, or expired without heartbeats): 410, which is how
    the SDK's heartbeat loop learns to stop."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=410)


class Unavailable(ServiceError):
    """The server drains (SIGTERM) or lost a rank: try again elsewhere or later."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, category=SERVER)


def describe(exc: BaseException) -> tuple[str, str]:
    """(one-sentence message, category) of a failed request."""
    if isinstance(exc, ServiceError):
        return exc.message, exc.category
    if isinstance(exc, VeoptimError):
        return str(exc), USER
    return f"internal server error ({type(exc).__name__}: {exc}).", SERVER


class Redactor:
    """Takes the server's own paths and store entry names out of a message before a tenant
    reads it: a checkpoint or slot error names files under ``run.dir``, which are the
    server's business. Each path under a private root becomes ``<server path>``, each
    entry name ``<store entry>``."""

    def __init__(self, private_roots: Iterable[str | os.PathLike[str]]) -> None:
        roots: set[str] = set()
        for root in private_roots:
            for form in (Path(root).absolute(), Path(root).resolve()):
                text = str(form).rstrip("/")
                if len(text) > 1:
                    roots.add(text)
        alternatives = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
        # a root and whatever path continues it, up to a space, quote or closing bracket
        self._paths = re.compile(rf"(?:{alternatives})(?:/[^\s'\"(),\]]*)?") if roots else None

    def __call__(self, message: str) -> str:
        if self._paths is not None:
            message = self._paths.sub("<server path>", message)
        return STORE_REF.sub("<store entry>", message)
