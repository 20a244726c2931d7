"""What every route is given through FastAPI's ``Depends``: the service, the tenant of
the request's API key, and its typed body.

The tenant comes from one dependency, :func:`tenant`: a route that declares it refuses a
missing or unknown ``X-API-Key`` (401) before anything else runs. Keys are looked up in
memory (:class:`~veoptim.service.auth.KeyTable`); everything that blocks (the database,
queueing a request) runs in the service's I/O threads (:func:`blocking`), never on the
event loop. A body is read within ``serve.max_request_bytes`` and validated against its
pydantic model (the SDK's own ``tinker.types`` where the wire shape is the same); a
refusal names the field, and a refused request of a model still uses its ``seq_id``.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import pydantic
from fastapi import Depends, Request

from veoptim.service.auth import HEADER
from veoptim.service.db import ModelStatus, Tenant
from veoptim.service.engine import Model
from veoptim.service.errors import NotFound, ServiceError, TooLarge, Unauthorized
from veoptim.service.runtime import Service
from veoptim.service.wire import decompress

API = "/api/v1"
T = TypeVar("T")
M = TypeVar("M", bound=pydantic.BaseModel)
#: A union branch's class name in a validation error's location (not a field).
_BRANCH = re.compile(r"^[A-Z]\w*$|^function-")


async def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


async def blocking(service: Service, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)`` in the service's I/O threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(service.io, functools.partial(call, *args))


async def tenant(request: Request) -> Tenant:
    """The tenant of the request's ``X-API-Key``; 401 without a known one."""
    service: Service = request.app.state.service
    key = request.headers.get(HEADER)
    if not key:
        raise Unauthorized(f"the {HEADER} header is missing; set TINKER_API_KEY.")
    found = service.keys.get(key)
    if found is None:
        found = await blocking(service, service.keys.lookup_stored, key)
    if found is None:
        raise Unauthorized("the API key is not known to this server.")
    request.state.tenant = found.name
    return found


TenantDep = Annotated[Tenant, Depends(tenant)]


async def read_body(request: Request, service: Service) -> bytes:
    """The body, within ``serve.max_request_bytes`` (also once decompressed)."""
    limit = service.cfg.serve.max_request_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the body of {declared} bytes exceeds serve.max_request_bytes={limit}.")
    raw = await request.body()
    if len(raw) > limit:
        raise TooLarge(f"the body exceeds serve.max_request_bytes={limit}.")
    return decompress(raw, request.headers.get("content-encoding", ""), limit)


class _Header(pydantic.BaseModel):
    """What a refused body must still tell: its model and ``seq_id``."""

    model_id: str | None = None
    seq_id: int | None = None


def body(model: type[M], kind: str = "") -> Any:
    """A ``Depends`` that reads the body as ``model``. ``kind``: the op of a request in
    its model's order, whose ``seq_id`` a refused body still uses."""

    async def parse(request: Request, tenant: TenantDep, service: ServiceDep) -> M:
        raw = await read_body(request, service)
        try:
            return model.model_validate_json(raw or b"{}")
        except pydantic.ValidationError as exc:
            if kind:
                _refused(request, service, tenant, raw, kind)
            raise ServiceError(validation_message(exc)) from None

    return Depends(parse)


def _refused(request: Request, service: Service, tenant: Tenant, raw: bytes, kind: str) -> None:
    try:
        header = _Header.model_validate_json(raw)
    except pydantic.ValidationError:
        return
    if header.model_id is not None and header.seq_id is not None:
        request.state.model, request.state.seq = header.model_id, header.seq_id
        service.engine.refused(tenant.id, header.model_id, header.seq_id, kind)


def validation_message(exc: pydantic.ValidationError) -> str:
    """One sentence naming the first field that did not validate."""
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"] if not _BRANCH.match(str(part)))
    what = error["msg"][:1].lower() + error["msg"][1:]
    if error["type"] == "json_invalid":
        return f"the body is not valid JSON: {what}."
    if not where:
        return f"the body is not valid: {what}."
    if error["type"] == "missing":
        return f"{where} is required."
    return f"{where}: {what} (got {error['input']!r:.80})."


def idempotency_key(request: Request) -> str:
    return request.headers.get("x-idempotency-key", "")


def seq_of(request: Request, seq_id: int | None) -> int:
    """A model request's ``seq_id`` (the SDK numbers them from 1)."""
    request.state.seq = "-" if seq_id is None else seq_id
    if seq_id is None:
        raise ServiceError("seq_id is required: the SDK numbers a model's requests from 1.")
    if seq_id < 1:
        raise ServiceError(f"seq_id must be >= 1 (the SDK counts from 1), got {seq_id}.")
    return seq_id


async def live_model(request: Request, service: Service, tenant: Tenant, model_id: str) -> Model:
    """The tenant's live model ``model_id``; not found names a model a restart lost."""
    request.state.model = model_id
    try:
        return service.engine.model(model_id, tenant.id)
    except NotFound:
        status = await blocking(service, service.db.model_status, tenant.id, model_id)
        if status == ModelStatus.LOST:
            raise NotFound(
                f"model_id {model_id!r} was lost when this server restarted (models live in "
                "memory); continue from its last checkpoint with "
                "create_training_client_from_state_with_optimizer."
            ) from None
        raise
