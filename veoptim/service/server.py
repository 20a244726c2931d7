"""Run the service: the worker on the main thread, uvicorn serving :func:`create_app` on
a side thread, until SIGTERM or SIGINT.

The worker runs on the main thread because the model was built there: torch's CPU
kernels share OpenMP thread teams per calling thread, and a second thread computing on
the same model measured slower (``docs/benchmarks.md``). The first signal drains: new
requests are refused (503), the running and queued ones finish (or fail with a
``server`` error after ``serve.drain_timeout_s``), their results stay retrievable for a
few seconds, then the HTTP server stops and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import uvicorn

from veoptim.errors import ConfigError
from veoptim.service.app import create_app
from veoptim.service.runtime import Service

log = logging.getLogger("veoptim.service")
#: After the drain: how long clients may still fetch the last results.
LINGER_S = 3.0
STARTUP_TIMEOUT_S = 60.0


def uvicorn_config(app: Any, host: str, port: int) -> uvicorn.Config:
    """The HTTP server's settings (also the tests' in-process server's). HTTP is parsed by
    httptools, in C: h11, uvicorn's pure-Python fallback, took about a third of the
    server's CPU per request (``docs/benchmarks.md``)."""
    return uvicorn.Config(app, host=host, port=port, http="httptools", log_config=None,
                          access_log=False, timeout_graceful_shutdown=5, lifespan="off")  # fmt: skip


def serve(service: Service) -> None:
    """Serve until a signal; then drain and close. Returns normally (exit status 0)."""
    cfg = service.cfg.serve
    # off the main thread, uvicorn installs no signal handlers
    http = uvicorn.Server(uvicorn_config(create_app(service), cfg.host, cfg.port))
    thread = threading.Thread(target=http.run, name="veoptim-service-http", daemon=True)

    def on_signal(sig: int, frame: object) -> None:
        if service.engine.stopping:
            return
        log.info("signal %d: draining (serve.drain_timeout_s=%g)", sig, cfg.drain_timeout_s)
        service.engine.request_stop(cfg.drain_timeout_s)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    service.start(worker_thread=False)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not http.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not http.started:
            raise ConfigError(
                f"the HTTP server did not start on serve.host={cfg.host} serve.port={cfg.port} "
                "(in use? see the log above)."
            )
        service.engine.run()
        service.engine.stop(0)  # fail what did not run; results stay retrievable a while
        time.sleep(LINGER_S)
    finally:
        http.should_exit = True
        thread.join(15)
        service.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped")
