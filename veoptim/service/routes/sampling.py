"""Sampling routes: sampling sessions, ``samplers/{id}``, ``asample``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from tinker import types

from veoptim.service.routes.deps import API, ServiceDep, TenantDep, blocking, body
from veoptim.service.runtime import Service

router = APIRouter(prefix=API)


@router.post("/create_sampling_session")
async def create_sampling_session(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.CreateSamplingSessionRequest, body(types.CreateSamplingSessionRequest)],
) -> dict[str, Any]:  # fmt: skip
    sampler_id = await blocking(service, _create, service, tenant.id, request)
    http.state.model = sampler_id
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def _create(service: Service, tenant_id: int, request: types.CreateSamplingSessionRequest) -> str:
    session_id = service.sessions.check(tenant_id, request.session_id)
    return service.samplers.create(tenant_id, session_id, request)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    found = await blocking(service, service.samplers.get, tenant.id, sampler_id)
    return {"sampler_id": found.id, "base_model": found.base_model, "model_path": found.model_path}


@router.post("/asample")
async def asample(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.SampleRequest, body(types.SampleRequest)],
) -> dict[str, Any]:  # fmt: skip
    http.state.model = request.sampling_session_id or "-"
    http.state.seq = "-" if request.seq_id is None else request.seq_id
    return await blocking(service, service.samplers.submit, tenant.id, request)
