"""The HTTP routes of the Tinker API (SDK 0.38.0), under ``/api/v1``: module-level
functions with typed bodies, grouped by what they serve. Every route but ``healthz`` and
a signed download link gets its tenant from :func:`deps.tenant` (``X-API-Key``)."""

from veoptim.service.routes import results, runs, sampling, session, training

ROUTERS = (session.router, training.router, sampling.router, results.router, runs.router)

__all__ = ["ROUTERS"]
