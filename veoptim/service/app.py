"""The HTTP routes of the Tinker API (SDK 0.38.0), under ``/api/v1``.

Every route but ``healthz`` needs a known ``X-API-Key``. Mutating calls answer a future
(``{request_id, model_id}``) whose result ``retrieve_future`` long-polls; refusals are a
4xx whose ``detail`` is one sentence naming the field. One log line per request: tenant,
endpoint, model, seq_id, status, milliseconds (never a key or a token).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from veoptim.service import paths
from veoptim.service.auth import HEADER, key_hash
from veoptim.service.db import LOST, PENDING
from veoptim.service.errors import NotFound, ServiceError, TooLarge, Unauthorized
from veoptim.service.runtime import Service
from veoptim.service.wire import PROTOBUF, decode_forward_backward, decompress

log = logging.getLogger("veoptim.service")
API = "/api/v1"


class RequestLog:
    """One log line per request (tenant, endpoint, model, seq_id, status, ms), which the
    routes fill in through ``request.state``. A plain ASGI wrapper: Starlette's
    ``BaseHTTPMiddleware`` runs every request through an extra task and memory streams."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500
        state = scope.setdefault("state", {})
        state.update(tenant="-", model="-", seq="-")

        async def send_noting_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            log.info("request tenant=%s endpoint=%s %s model=%s seq_id=%s status=%d ms=%.1f",
                     state["tenant"], scope["method"], scope["path"], state["model"],
                     state["seq"], status, 1000 * (time.monotonic() - start))  # fmt: skip


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="veoptim training service", docs_url=None, redoc_url=None)
    db, engine, backend, cfg = service.db, service.engine, service.backend, service.cfg

    app.add_middleware(RequestLog)

    @app.exception_handler(ServiceError)
    async def refused(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    def tenant(request: Request) -> int:
        key = request.headers.get(HEADER)
        if not key:
            raise Unauthorized(f"the {HEADER} header is missing; set TINKER_API_KEY.")
        row = db.tenant_by_hash(key_hash(key))
        if row is None:
            raise Unauthorized("the API key is not known to this server.")
        request.state.tenant = row["name"]
        return int(row["id"])

    async def body_bytes(request: Request) -> bytes:
        limit = cfg.serve.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"the body of {declared} bytes exceeds serve.max_request_bytes={limit}.")
        raw = await request.body()
        if len(raw) > limit:
            raise TooLarge(f"the body exceeds serve.max_request_bytes={limit}.")
        return decompress(raw, request.headers.get("content-encoding", ""), limit)

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await body_bytes(request)
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            raise ServiceError(f"the body is not valid JSON ({exc}).") from exc
        if not isinstance(body, dict):
            raise ServiceError("the body must be a JSON object.")
        return body

    def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...],
              required: bool = True) -> Any:  # fmt: skip
        value = body.get(name)
        if value is None and not required:
            return None
        if (
            value is None
            or not isinstance(value, kind)
            or (kind is int and isinstance(value, bool))
        ):
            expected = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise ServiceError(f"{name} must be a {expected}, got {value!r}.")
        return value

    def model_of(request: Request, body: dict[str, Any], tenant_id: int) -> Any:
        return live_model(request, field(body, "model_id", str), tenant_id)

    def live_model(request: Request, model_id: str, tenant_id: int) -> Any:
        """The tenant's live model ``model_id``; not found names a model a restart lost."""
        request.state.model = model_id
        try:
            return engine.model(model_id, tenant_id)
        except NotFound:
            if db.model_status(model_id, tenant_id) == LOST:
                raise NotFound(
                    f"model_id {model_id!r} was lost when this server restarted (models live "
                    "in memory); continue from its last checkpoint with "
                    "create_training_client_from_state_with_optimizer."
                ) from None
            raise

    def seq_of(request: Request, body: dict[str, Any]) -> int:
        seq = field(body, "seq_id", int)
        request.state.seq = seq
        if seq < 1:
            raise ServiceError(f"seq_id must be >= 1 (the SDK counts from 1), got {seq}.")
        return seq

    def future(f: Any) -> dict[str, Any]:
        return {"request_id": f.id, "model_id": f.model_id}

    def submit_in_order(request: Request, tenant_id: int, model: Any, seq: int, kind: str,
                        prepare: Callable[[], Any]) -> dict[str, Any]:  # fmt: skip
        """Queue ``model``'s request ``seq``; the SDK's retry of it carries the same
        ``X-Idempotency-Key`` and gets the first submission's future back."""
        key = request.headers.get("x-idempotency-key", "")
        return future(engine.submit(tenant_id, model, seq, kind, prepare, key))

    # ------------------------------------------------------------------ session
    @app.get(f"{API}/healthz")
    async def healthz() -> JSONResponse:
        used, free = service.slots()
        lost = service.served.lost
        body = {"status": "lost_rank" if lost else "ok", "slots_used": used, "slots_free": free,
                "ranks": service.served.world}  # fmt: skip
        if lost:
            body["error"] = lost
        return JSONResponse(body, status_code=503 if lost else 200)

    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
                "custom_loss_server_side": False, "sample_use_retrieve_futures": False,
                "fwdbwd_max_chunk_len": cfg.serve.max_datums}  # fmt: skip

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config(request: Request) -> dict[str, Any]:
        tenant(request)
        return {"refresh_interval_sec": 300}

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        await json_body(request)
        session_id = uuid.uuid4().hex[:16]
        now = time.time()
        db.execute("INSERT INTO sessions (id, tenant_id, created, last_heartbeat) VALUES (?, ?, ?, ?)",
                   (session_id, tenant_id, now, now))  # fmt: skip
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def session_heartbeat(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        session_id = field(await json_body(request), "session_id", str)
        backend.check_session(session_id, tenant_id)  # 400/404: the SDK logs and goes on
        db.execute("UPDATE sessions SET last_heartbeat = ? WHERE id = ?", (time.time(), session_id))
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request) -> dict[str, Any]:
        tenant(request)
        await request.body()
        return {"status": "accepted"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        row = db.one("SELECT finished FROM sessions WHERE id = ? AND tenant_id = ?",
                     (session_id, tenant_id))  # fmt: skip
        if row is None:
            raise ServiceError(f"session {session_id!r} is not a session of this tenant.", 404)
        reason = body.get("reason")
        kind = str(reason.get("type", "finished")) if isinstance(reason, dict) else "finished"
        for unload in service.finish_session(session_id, kind):  # answer once the slots are free
            await service.futures.wait(unload, cfg.serve.poll_timeout_s)
        return {}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities(request: Request) -> dict[str, Any]:
        tenant(request)
        return {"supported_models": [{"model_name": backend.base_model, "trainable": True,
                                      "max_context_length": backend.max_tokens,
                                      "sampleable": True}]}  # fmt: skip

    # ------------------------------------------------------------------ models
    @app.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        session_id = backend.check_session(field(body, "session_id", str), tenant_id)
        backend.check_base_model(field(body, "base_model", str))
        lora = field(body, "lora_config", dict, required=False)
        if lora is None:
            raise ServiceError("lora_config is required: this server trains LoRA adapters only.")
        hyper = backend.lora_hyper(lora)
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise ServiceError(f"optimizer_config {optimizer!r} is not supported; only adamw.")
        model = backend.new_model(tenant_id, session_id, body.get("model_seq_id"))
        request.state.model = model.id
        f = engine.submit(tenant_id, model, 0, "create_model",
                          lambda: backend.prepare_create(model, hyper, body.get("user_metadata")))  # fmt: skip
        return future(f)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        model = model_of(request, await json_body(request), tenant_id)
        return {
            "type": "get_info", "model_id": model.id, "is_lora": True, "lora_rank": model.rank,
            "model_name": backend.base_model,
            "model_data": {"arch": backend.arch, "model_name": backend.base_model,
                           "tokenizer_id": backend.tokenizer_dir},
        }  # fmt: skip

    @app.post(f"{API}/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        model = model_of(request, await json_body(request), tenant_id)
        f = engine.submit(
            tenant_id, None, None, "unload_model", lambda: backend.prepare_unload(model)
        )
        return {**future(f), "model_id": model.id}

    # ------------------------------------------------------------------ training
    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        raw = await body_bytes(request)
        fb = decode_forward_backward(raw)
        request.state.seq = fb.seq_id
        model = live_model(request, fb.model_id, tenant_id)
        if fb.seq_id < 1:
            raise ServiceError(f"seq_id must be >= 1 (the SDK counts from 1), got {fb.seq_id}.")
        kind = "forward" if fb.forward_only else "forward_backward"
        return submit_in_order(request, tenant_id, model, fb.seq_id, kind,
                               lambda: backend.prepare_forward_backward(model, fb))  # fmt: skip

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        model = model_of(request, body, tenant_id)
        seq = seq_of(request, body)
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            if "optimizer_params" in body:
                raise ServiceError("optimizer_params: only adam_params (AdamParams) are supported.")
            raise ServiceError(f"adam_params must be an object of AdamParams, got {adam!r}.")
        return submit_in_order(request, tenant_id, model, seq, "optim_step",
                               lambda: backend.prepare_optim_step(model, adam))  # fmt: skip

    # ------------------------------------------------------------------ checkpoints
    async def save(request: Request, kind: str) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        model = model_of(request, body, tenant_id)
        seq = seq_of(request, body)
        name = field(body, "path", str, required=False)
        overwrite = bool(body.get("overwrite", False))
        sampling_seq = body.get("sampling_session_seq_id")
        return submit_in_order(request, tenant_id, model, seq, "save_weights",
                               lambda: backend.prepare_save(model, name, seq, kind, overwrite,
                                                            sampling_seq))  # fmt: skip

    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        return await save(request, paths.TRAINING)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        return await save(request, paths.SAMPLER)

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        path = field(body, "path", str)
        optimizer = field(body, "optimizer", bool)
        paths.parse(path)
        if body.get("model_id") is None:  # create a model by loading a checkpoint
            session_id = backend.check_session(field(body, "session_id", str), tenant_id)
            backend.check_base_model(body.get("base_model"))
            model = backend.new_model(tenant_id, session_id, body.get("model_seq_id"))
            request.state.model = model.id
            f = engine.submit(tenant_id, model, 0, "load_weights",
                              lambda: backend.prepare_create_by_load(model, path, optimizer,
                                                                     body.get("user_metadata")))  # fmt: skip
            return future(f)
        model = model_of(request, body, tenant_id)
        seq = seq_of(request, body)
        return submit_in_order(request, tenant_id, model, seq, "load_weights",
                               lambda: backend.prepare_load(model, path, optimizer))  # fmt: skip

    # ------------------------------------------------------------------ sampling
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        session_id = backend.check_session(field(body, "session_id", str), tenant_id)
        sid = backend.samplers.create(tenant_id, session_id, body.get("sampling_session_seq_id"),
                                      body.get("model_path"), body.get("base_model"))  # fmt: skip
        request.state.model = sid
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
        row = backend.samplers.get(sampler_id, tenant(request))
        return {"sampler_id": row["id"], "base_model": row["base_model"],
                "model_path": row["model_path"]}  # fmt: skip

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        body = await json_body(request)
        request.state.model = str(body.get("sampling_session_id") or "-")
        request.state.seq = body.get("seq_id", "-")
        ids: list[str] = []

        def prepare() -> Any:
            op, sample_ids = backend.samplers.prepare(tenant_id, body)
            ids.extend(sample_ids)
            return op

        f = engine.submit(tenant_id, None, None, "sample", prepare)
        return {**future(f), "sample_sequence_ids": ids}

    # ------------------------------------------------------------------ futures
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        tenant_id = tenant(request)
        request_id = field(await json_body(request), "request_id", str)
        f = service.futures.lookup(request_id, tenant_id)
        request.state.model = f.model_id or "-"
        if f.status == PENDING:
            await service.futures.wait(f, cfg.serve.poll_timeout_s)
        if f.status == PENDING:
            return JSONResponse({"type": "try_again", "request_id": f.id, "queue_state": "active"})
        service.futures.retrieved(f)
        if f.error:
            return JSONResponse({"error": f.error, "category": f.category})
        if isinstance(f.result, bytes):
            return Response(f.result, media_type=PROTOBUF)
        return JSONResponse(f.result)

    # ------------------------------------------------------------------ runs, checkpoints
    def run_row(run_id: str, tenant_id: int) -> Any:
        row = db.one(
            "SELECT r.*, t.name AS owner FROM training_runs r JOIN tenants t ON t.id = r.tenant_id "
            "WHERE r.id = ? AND r.tenant_id = ?", (run_id, tenant_id),
        )  # fmt: skip
        if row is None:
            raise ServiceError(f"training run {run_id!r} was not found.", 404)
        return row

    def checkpoint_json(row: Any) -> dict[str, Any]:
        ref = paths.CheckpointRef(row["run_id"], row["kind"], row["name"])
        return {"checkpoint_id": ref.checkpoint_id, "checkpoint_type": row["kind"],
                "time": iso(row["created"]), "tinker_path": ref.path,
                "size_bytes": row["size_bytes"], "public": False}  # fmt: skip

    def run_json(row: Any) -> dict[str, Any]:
        latest = {kind: db.one("SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? "
                               "ORDER BY created DESC LIMIT 1", (row["id"], kind))
                  for kind in (paths.TRAINING, paths.SAMPLER)}  # fmt: skip
        return {
            "training_run_id": row["id"], "base_model": row["base_model"], "model_owner": row["owner"],
            "is_lora": True, "corrupted": False, "lora_rank": row["lora_rank"],
            "last_request_time": iso(row["last_request"]),
            "last_checkpoint": checkpoint_json(latest[paths.TRAINING]) if latest[paths.TRAINING] else None,
            "last_sampler_checkpoint": checkpoint_json(latest[paths.SAMPLER]) if latest[paths.SAMPLER] else None,
            "user_metadata": json.loads(row["user_metadata"]) if row["user_metadata"] else None,
        }  # fmt: skip

    @app.get(f"{API}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        tenant_id = tenant(request)
        if not 1 <= limit <= 1000 or offset < 0:
            raise ServiceError("limit must be in [1, 1000] and offset >= 0.")
        total = db.one("SELECT COUNT(*) AS n FROM training_runs WHERE tenant_id = ?", (tenant_id,))
        rows = db.all(
            "SELECT r.*, t.name AS owner FROM training_runs r JOIN tenants t ON t.id = r.tenant_id "
            "WHERE r.tenant_id = ? ORDER BY r.created DESC LIMIT ? OFFSET ?",
            (tenant_id, limit, offset),
        )
        return {"training_runs": [run_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total["n"]}}  # fmt: skip

    @app.get(f"{API}/training_runs/{{run_id}}")
    async def training_run(run_id: str, request: Request) -> dict[str, Any]:
        return run_json(run_row(run_id, tenant(request)))

    @app.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def checkpoints(run_id: str, request: Request) -> dict[str, Any]:
        tenant_id = tenant(request)
        run_row(run_id, tenant_id)
        rows = db.all("SELECT * FROM checkpoints WHERE run_id = ? AND tenant_id = ? ORDER BY created",
                      (run_id, tenant_id))  # fmt: skip
        return {"checkpoints": [checkpoint_json(r) for r in rows], "cursor": None}

    @app.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(
        run_id: str, checkpoint_id: str, request: Request
    ) -> dict[str, Any]:
        tenant_id = tenant(request)
        ref = paths.parse_checkpoint_id(run_id, checkpoint_id)
        row = db.one("SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? "
                     "AND name = ?", (tenant_id, run_id, ref.kind, ref.name))  # fmt: skip
        if row is None:
            raise ServiceError(f"checkpoint {ref.path} was not found.", 404)
        db.execute("DELETE FROM checkpoints WHERE id = ?", (row["id"],))
        store_ref = row["store_ref"]
        engine.submit(tenant_id, None, None, "delete_checkpoint",
                      lambda: _deletion(backend, store_ref))  # fmt: skip
        return {}

    return app


def _deletion(backend: Any, store_ref: str) -> Any:
    from veoptim.service.engine import Op

    def run() -> dict[str, Any]:
        backend.remove_store_entry(store_ref)
        return {}

    return Op("delete_checkpoint", None, run=run)


def iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
