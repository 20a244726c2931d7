"""Training runs and checkpoints of the tenant: listed, deleted, and a
weights-only checkpoint's PEFT adapter downloaded through signed links (``get_external_weights_urls``;
the link route is the one that takes no key: the link's signature names the tenant)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from veoptim.service import paths
from veoptim.service.checkpoints import DOWNLOADS
from veoptim.service.db import CheckpointKind
from veoptim.service.errors import NotFound
from veoptim.service.routes.deps import API, ServiceDep, TenantDep, blocking
from veoptim.service.runtime import Service

router = APIRouter(prefix=API)
ADAPTER_CONFIG = "adapter_config.json"


@router.get("/training_runs")
async def training_runs(tenant: TenantDep, service: ServiceDep, limit: int = 20,
                        offset: int = 0) -> dict[str, Any]:  # fmt: skip
    return await blocking(service, service.catalog.runs, tenant.id, limit, offset)


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    return await blocking(service, service.catalog.run, tenant.id, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def checkpoints(run_id: str, tenant: TenantDep, service: ServiceDep) -> dict[str, Any]:
    return await blocking(service, service.catalog.checkpoints, tenant.id, run_id)


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def download_urls(request: Request, run_id: str, checkpoint_id: str, tenant: TenantDep,
                        service: ServiceDep) -> dict[str, Any]:  # fmt: skip
    """Signed URLs of a weights-only checkpoint's PEFT adapter files (``RestClient.
    get_external_weights_urls``): plain ``peft`` loads the directory they fill."""
    await blocking(service, service.checkpoints.downloadable, tenant.id, run_id, checkpoint_id)
    ref = paths.parse_checkpoint_id(run_id, checkpoint_id)
    token, expires = service.links.sign(tenant.id, ref.path)
    base = str(request.base_url).rstrip("/")
    return {"urls": {name: f"{base}{API}/downloads/{token}/{name}" for name in DOWNLOADS},
            "expires": datetime.fromtimestamp(expires, tz=timezone.utc).isoformat()}  # fmt: skip


@router.get("/downloads/{token}/{name}")
async def download(token: str, name: str, service: ServiceDep) -> Response:
    """A file of a signed link (no key: the link names the tenant and the checkpoint)."""
    tenant_id, path = service.links.verify(token)
    if name not in DOWNLOADS:
        raise NotFound(
            f"name {name!r} is not a file of a checkpoint's download; one of {list(DOWNLOADS)}."
        )
    directory = await blocking(service, _export_of, service, tenant_id, path)
    if name == ADAPTER_CONFIG:  # it names the base as this server's files: name it as served
        text = await blocking(service, (directory / name).read_text)
        return Response(_public_config(text, service.base.name), media_type="application/json")
    return FileResponse(directory / name, media_type="application/octet-stream")


def _export_of(service: Service, tenant_id: int, tinker_path: str) -> Any:
    ref = paths.parse(tinker_path, kinds=tuple(CheckpointKind))
    return service.checkpoints.downloadable(tenant_id, ref.run_id, ref.checkpoint_id)


def _public_config(text: str, base_model: str) -> str:
    config = json.loads(text)
    config["base_model_name_or_path"] = base_model
    return json.dumps(config, indent=2) + "\n"


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, tenant: TenantDep,
                            service: ServiceDep) -> dict[str, Any]:  # fmt: skip
    await blocking(service, service.checkpoints.delete, tenant.id, run_id, checkpoint_id)
    return {}
