"""``retrieve_future``: the long poll for a request's result (only the tenant's own)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from veoptim.service.db import FutureStatus
from veoptim.service.routes.deps import API, ServiceDep, TenantDep, blocking, body
from veoptim.service.wire import PROTOBUF

router = APIRouter(prefix=API)


@router.post("/retrieve_future")
async def retrieve_future(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.FutureRetrieveRequest, body(types.FutureRetrieveRequest)],
) -> Response:  # fmt: skip
    futures = service.futures
    found = futures.in_memory(request.request_id, tenant.id)
    if found is None:  # a request of an earlier server process
        found = await blocking(service, futures.lookup, request.request_id, tenant.id)
    http.state.model = found.model_id or "-"
    if found.status == FutureStatus.PENDING:
        await futures.wait(found, service.cfg.serve.poll_timeout_s)
    if found.status == FutureStatus.PENDING:
        return JSONResponse({"type": "try_again", "request_id": found.id, "queue_state": "active"})
    futures.retrieved(found)
    if found.error:
        return JSONResponse({"error": found.error, "category": found.category})
    if isinstance(found.result, bytes):
        return Response(found.result, media_type=PROTOBUF)
    return JSONResponse(found.result)
