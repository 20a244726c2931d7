"""Training routes: models (create, info, unload), ``forward_backward`` / ``forward``,
``optim_step``, and the checkpoint calls of a model (save, load). Each answers a future
(``{request_id, model_id}``) at once; the work runs on the worker in the model's
``seq_id`` order."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from tinker import types

from veoptim.service.db import CheckpointKind
from veoptim.service.errors import ServiceError
from veoptim.service.routes.deps import (
    API,
    ServiceDep,
    TenantDep,
    blocking,
    body,
    idempotency_key,
    live_model,
    read_body,
    seq_of,
)
from veoptim.service.runtime import Service
from veoptim.service.wire import decode_forward_backward

router = APIRouter(prefix=API)


@router.post("/create_model")
async def create_model(
    tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.CreateModelRequest, body(types.CreateModelRequest)],
) -> dict[str, Any]:  # fmt: skip
    def create() -> dict[str, Any]:
        session_id = service.sessions.check(tenant.id, request.session_id)
        return service.backend.submit_create(tenant.id, session_id, request)

    return await blocking(service, create)


@router.post("/get_info")
async def get_info(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.GetInfoRequest, body(types.GetInfoRequest)],
) -> dict[str, Any]:  # fmt: skip
    model, base = await live_model(http, service, tenant, request.model_id), service.base
    return {
        "type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
        "model_name": base.name,
        "model_data": {"arch": base.arch, "model_name": base.name, "tokenizer_id": base.tokenizer_dir},
    }  # fmt: skip


@router.post("/unload_model")
async def unload_model(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.UnloadModelRequest, body(types.UnloadModelRequest)],
) -> dict[str, Any]:  # fmt: skip
    model = await live_model(http, service, tenant, request.model_id)
    return await blocking(service, service.backend.submit_unload, model)


@router.post("/forward_backward")
async def forward_backward(http: Request, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    request = decode_forward_backward(await read_body(http, service))
    seq_of(http, request.seq_id)
    model = await live_model(http, service, tenant, request.model_id)
    return await blocking(service, service.backend.submit_forward_backward, model, request,
                          idempotency_key(http))  # fmt: skip


@router.post("/optim_step")
async def optim_step(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.OptimStepRequest, body(types.OptimStepRequest, "optim_step")],
) -> dict[str, Any]:  # fmt: skip
    model = await live_model(http, service, tenant, request.model_id)
    seq_id = seq_of(http, request.seq_id)
    return await blocking(service, service.backend.submit_optim_step, model, seq_id,
                          request.optim_params, idempotency_key(http))  # fmt: skip


@router.post("/save_weights")
async def save_weights(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.SaveWeightsRequest, body(types.SaveWeightsRequest, "save_weights")],
) -> dict[str, Any]:  # fmt: skip
    model = await live_model(http, service, tenant, request.model_id)
    seq_id = seq_of(http, request.seq_id)
    return await blocking(service, service.checkpoints.submit_save, model, seq_id,
                          CheckpointKind.TRAINING, request.path, request.overwrite, None,
                          idempotency_key(http))  # fmt: skip


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.SaveWeightsForSamplerRequest,
                       body(types.SaveWeightsForSamplerRequest, "save_weights")],
) -> dict[str, Any]:  # fmt: skip
    model = await live_model(http, service, tenant, request.model_id)
    seq_id = seq_of(http, request.seq_id)
    return await blocking(service, service.checkpoints.submit_save, model, seq_id,
                          CheckpointKind.WEIGHTS_ONLY, request.path, False,
                          request.sampling_session_seq_id, idempotency_key(http))  # fmt: skip


@router.post("/save_weights_external")
async def save_weights_external(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.SaveWeightsExternalRequest,
                       body(types.SaveWeightsExternalRequest, "save_weights")],
) -> dict[str, Any]:  # fmt: skip
    model = await live_model(http, service, tenant, request.model_id)
    seq_id = seq_of(http, request.seq_id)
    return await blocking(service, service.checkpoints.submit_save_external, model, seq_id,
                          request, idempotency_key(http))  # fmt: skip


@router.post("/load_weights")
async def load_weights(
    http: Request, tenant: TenantDep, service: ServiceDep,
    request: Annotated[types.LoadWeightsRequest, body(types.LoadWeightsRequest, "load_weights")],
) -> dict[str, Any]:  # fmt: skip
    if request.model_id is None:  # create a model by loading a checkpoint
        return await blocking(service, _create_by_load, service, tenant.id, request)
    model = await live_model(http, service, tenant, request.model_id)
    seq_id = seq_of(http, request.seq_id)
    return await blocking(service, service.checkpoints.submit_load, model, seq_id, request.path,
                          request.optimizer, idempotency_key(http))  # fmt: skip


def _create_by_load(service: Service, tenant_id: int, request: types.LoadWeightsRequest,
                    ) -> dict[str, Any]:  # fmt: skip
    if request.session_id is None:
        raise ServiceError(
            "model_id or session_id is required: a load goes into a model, or creates one."
        )
    session_id = service.sessions.check(tenant_id, request.session_id)
    return service.checkpoints.submit_create_by_load(tenant_id, session_id, request)
