"""Signed download links: what ``get_external_weights_urls`` answers for a tenant's
checkpoint. A download client (the SDK's ``tinker checkpoint download``, ``urllib``)
sends no API key, so the link itself carries who may read what until when, signed
with a secret of this server process (HMAC-SHA256): it stops working when it expires or
the server restarts, and names the ``tinker://`` path, never a server path or entry."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time

from veoptim.service.errors import Unauthorized

#: How long a link works.
TTL_S = 3600.0
INVALID = "the download link is not valid, or has expired; ask for the checkpoint's URLs again."


class Links:
    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self._secret = secrets.token_bytes(32)

    def sign(self, tenant_id: int, tinker_path: str) -> tuple[str, float]:
        """A token for the tenant's checkpoint ``tinker_path``, and when it expires."""
        expires = time.time() + self.ttl_s
        payload = base64.urlsafe_b64encode(json.dumps([tenant_id, tinker_path, expires]).encode())
        return f"{payload.decode()}.{self._mac(payload)}", expires

    def verify(self, token: str) -> tuple[int, str]:
        """(tenant, tinker path) of a token this server signed that has not expired."""
        payload, _, mac = token.partition(".")
        if not hmac.compare_digest(mac, self._mac(payload.encode())):
            raise Unauthorized(INVALID)
        try:
            tenant_id, path, expires = json.loads(base64.urlsafe_b64decode(payload))
        except ValueError:
            raise Unauthorized(INVALID) from None
        if time.time() > float(expires):
            raise Unauthorized(INVALID)
        return int(tenant_id), str(path)

    def _mac(self, payload: bytes) -> str:
        return hmac.new(self._secret, payload, hashlib.sha256).hexdigest()
