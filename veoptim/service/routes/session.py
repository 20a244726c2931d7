"""Session routes: client config, sessions and heartbeats, telemetry, capabilities, and
``healthz`` (the one route without a key)."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types

from veoptim.service.routes.deps import (
    API,
    ServiceDep,
    TenantDep,
    blocking,
    body,
    read_body,
)

router = APIRouter(prefix=API)


class CreateSessionBody(pydantic.BaseModel):
    """``create_session``: nothing of it is kept (the SDK's ``CreateSessionRequest``
    requires ``sdk_version`` and ``user_metadata``; plain HTTP clients send less)."""

    model_config = pydantic.ConfigDict(extra="allow")


class FinishBody(pydantic.BaseModel):
    """``sessions/{id}/finish``: the SDK sends ``{"reason": {"type": ...}, "detail": ...}``."""

    model_config = pydantic.ConfigDict(extra="allow")
    reason: dict[str, Any] | str | None = None

    @property
    def kind(self) -> str:
        reason = self.reason
        return str(reason.get("type", "finished")) if isinstance(reason, dict) else "finished"


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    status, answer = request.app.state.service.health()
    return JSONResponse(answer, status_code=status)


@router.post("/client/config")
async def client_config(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
            "custom_loss_server_side": False, "sample_use_retrieve_futures": False,
            "fwdbwd_max_chunk_len": service.cfg.serve.max_datums}  # fmt: skip


@router.post("/client/dynamic_config")
async def client_dynamic_config(tenant: TenantDep) -> dict[str, Any]:
    return {"refresh_interval_sec": 300}


@router.post("/create_session")
async def create_session(tenant: TenantDep, service: ServiceDep,
                         _: Annotated[CreateSessionBody, body(CreateSessionBody)]) -> dict[str, Any]:  # fmt: skip
    session_id = await blocking(service, service.sessions.create, tenant.id)
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(
    tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.SessionHeartbeatRequest, body(types.SessionHeartbeatRequest)],
) -> dict[str, Any]:  # fmt: skip
    if not service.sessions.beat_in_memory(tenant.id, request.session_id):
        await blocking(service, service.sessions.heartbeat, tenant.id, request.session_id)
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
async def telemetry(request: Request, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    await read_body(request, service)  # accepted and dropped
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, tenant: TenantDep, service: ServiceDep,
                         request: Annotated[FinishBody, body(FinishBody)]) -> dict[str, Any]:  # fmt: skip
    releases = await blocking(service, service.sessions.finish, tenant.id, session_id, request.kind)
    for release in releases:  # answer once the slots are free
        await service.futures.wait(release, service.cfg.serve.poll_timeout_s)
    return {}


@router.get("/get_server_capabilities")
async def capabilities(tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    base = service.base
    return {"supported_models": [{"model_name": base.name, "trainable": True,
                                  "max_context_length": base.max_tokens, "sampleable": True}]}  # fmt: skip
