"""A tenant's training runs and checkpoints as the SDK's ``RestClient`` lists them
(``tinker.types.TrainingRun``, ``Checkpoint``, ``Cursor``): only the tenant's own, another
tenant's run answering *not found* like one that does not exist."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from veoptim.service import paths
from veoptim.service.db import Checkpoint, CheckpointKind, Database, Run
from veoptim.service.errors import NotFound, ServiceError

MAX_PAGE = 1000


class Catalog:
    def __init__(self, database: Database) -> None:
        self.db = database

    def runs(self, tenant_id: int, limit: int, offset: int) -> dict[str, Any]:
        """A page of the tenant's runs, newest first (``training_runs``)."""
        if not 1 <= limit <= MAX_PAGE:
            raise ServiceError(f"limit must be in [1, {MAX_PAGE}], got {limit}.")
        if offset < 0:
            raise ServiceError(f"offset must be >= 0, got {offset}.")
        runs, total = self.db.runs(tenant_id, limit, offset)
        return {"training_runs": [self._run_json(tenant_id, r) for r in runs],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}  # fmt: skip

    def run(self, tenant_id: int, run_id: str) -> dict[str, Any]:
        return self._run_json(tenant_id, self._find(tenant_id, run_id))

    def checkpoints(self, tenant_id: int, run_id: str) -> dict[str, Any]:
        self._find(tenant_id, run_id)
        found = self.db.checkpoints(tenant_id, run_id)
        return {"checkpoints": [checkpoint_json(c) for c in found], "cursor": None}

    def _find(self, tenant_id: int, run_id: str) -> Run:
        run = self.db.run(tenant_id, run_id)
        if run is None:
            raise NotFound(f"training run {run_id!r} was not found.")
        return run

    def _run_json(self, tenant_id: int, run: Run) -> dict[str, Any]:
        latest = {
            kind: self.db.latest_checkpoint(tenant_id, run.id, kind)
            for kind in (CheckpointKind.TRAINING, CheckpointKind.WEIGHTS_ONLY)
        }
        return {
            "training_run_id": run.id, "base_model": run.base_model, "model_owner": run.owner,
            "is_lora": True, "corrupted": False, "lora_rank": run.lora_rank,
            "last_request_time": iso(run.last_request),
            "last_checkpoint": _maybe(latest[CheckpointKind.TRAINING]),
            "last_sampler_checkpoint": _maybe(latest[CheckpointKind.WEIGHTS_ONLY]),
            "user_metadata": run.user_metadata,
        }  # fmt: skip


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    ref = paths.CheckpointRef(c.run_id, c.kind, c.name)
    return {"checkpoint_id": ref.checkpoint_id, "checkpoint_type": str(c.kind),
            "time": iso(c.created), "tinker_path": ref.path, "size_bytes": c.size_bytes,
            "public": False}  # fmt: skip


def _maybe(c: Checkpoint | None) -> dict[str, Any] | None:
    return None if c is None else checkpoint_json(c)


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
