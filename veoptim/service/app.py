"""The HTTP application: the routes of ``routes/``, one log line per request, and every
refusal answered as one sentence that names the field (never a server path or store
entry: messages pass the service's :class:`~veoptim.service.errors.Redactor`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from veoptim.service.errors import ServiceError
from veoptim.service.routes import ROUTERS
from veoptim.service.runtime import Service

log = logging.getLogger("veoptim.service")


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
    app = FastAPI(title="veoptim training service", docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.service = service
    app.add_middleware(RequestLog)
    for router in ROUTERS:  # each route itself on the app: matched in one flat list
        for route in router.routes:
            app.add_api_route(route.path, route.endpoint, methods=sorted(route.methods))

    @app.exception_handler(ServiceError)
    async def refused(request: Request, exc: ServiceError) -> JSONResponse:
        return JSONResponse({"detail": service.redact(exc.message)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _invalid(exc)}, status_code=400)

    return app


def _invalid(exc: RequestValidationError) -> str:
    """A path or query parameter that did not validate, as one sentence."""
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("path", "query", "body"))
    return f"{where or 'the request'}: {str(error.get('msg', 'invalid')).lower()}."
