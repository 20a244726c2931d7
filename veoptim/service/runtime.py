"""The service's parts put together: database, futures, trainer, backend, worker, and the
housekeeping thread (expired sessions, old results). One per server (rank 0 of a torchrun
job; the other ranks follow its trainer calls, ``veoptim/service/ranks.py``)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from veoptim.lora.slots import SlotTrainer
from veoptim.service.auth import read_keys_file
from veoptim.service.backend import Backend
from veoptim.service.config import ServeConfig
from veoptim.service.db import DB_FILE, Database
from veoptim.service.engine import UNLOADED, Engine, Op
from veoptim.service.futures import Future, FutureTable
from veoptim.service.ranks import ServedTrainer

log = logging.getLogger("veoptim.service")
RESTARTED = "the server restarted before this request finished; submit it again."


class Service:
    def __init__(self, cfg: ServeConfig, served: ServedTrainer | None = None) -> None:
        """``served``: the trainer of every rank of a torchrun job (built on all of them);
        by default one built from ``cfg`` in this process."""
        cfg.check_serve_keys()
        self.cfg = cfg
        run_dir = Path(cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database(run_dir / DB_FILE)
        failed = self.db.recover(RESTARTED)
        if failed:
            log.warning(
                "%d requests pending at the last shutdown now answer a server error", failed
            )
        if cfg.serve.keys_file:
            for name, digest in read_keys_file(cfg.serve.keys_file):
                self.db.add_tenant(name, digest)
        self.futures = FutureTable(self.db, cfg.serve.max_futures_per_tenant)
        if served is None:
            served = ServedTrainer(SlotTrainer.from_config(cfg), cfg.serve.rank_timeout_s)
        self.served, self.trainer = served, served.trainer
        self.backend = Backend(cfg, served, self.db)
        self.engine = Engine(
            self.futures,
            batch_tenants=cfg.serve.batch_tenants,
            gap_timeout_s=cfg.serve.seq_gap_timeout_s,
            run_batch=self.backend.run_batch,
        )
        self.backend.engine = self.engine
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeeping, daemon=True,
                                             name="veoptim-service-housekeeping")  # fmt: skip

    def start(self, worker_thread: bool = True) -> None:
        """Start housekeeping and (with ``worker_thread``) the worker on its own thread;
        without, the caller runs ``engine.run()`` itself (the server's main thread)."""
        if worker_thread:
            self.engine.start()
        self._housekeeper.start()
        log.info("serving %s: %d slots of rank <= %d; state in %s", self.backend.base_model,
                 self.trainer.num_slots, self.cfg.lora.r, self.db.path)  # fmt: skip

    def stop(self) -> None:
        """Drain: refuse new requests, finish the runnable ones (``serve.drain_timeout_s``),
        fail the rest, close the database."""
        self._stop.set()
        self.engine.stop(self.cfg.serve.drain_timeout_s)
        self._housekeeper.join(5)
        self.served.stop_followers()
        self.db.close()

    # ------------------------------------------------------------------ sessions
    def finish_session(self, session_id: str, reason: str) -> list[Future]:
        """Mark the session finished and unload its models; the unloads' futures."""
        self.db.execute(
            "UPDATE sessions SET finished = ?, finish_reason = ? WHERE id = ? AND finished IS NULL",
            (time.time(), reason, session_id),
        )
        unloads = [
            self.engine.submit(
                model.tenant_id,
                None,
                None,
                "unload_model",
                lambda m=model: self.backend.prepare_unload(m),
            )  # fmt: skip
            for model in list(self.engine.models.values())
            if model.session_id == session_id and model.status != UNLOADED
        ]
        row = self.db.one("SELECT tenant_id FROM sessions WHERE id = ?", (session_id,))
        if row is not None and self.db.one("SELECT 1 FROM samplers WHERE session_id = ?",
                                           (session_id,)):  # fmt: skip
            unloads.append(self.engine.submit(row["tenant_id"], None, None, "release_samplers",
                                              self._release_samplers))  # fmt: skip
        return unloads

    def _release_samplers(self) -> Op:
        def run() -> dict[str, str]:
            self.backend.samplers.release_unused()
            return {"type": "release_samplers"}

        return Op("release_samplers", None, run=run)

    def _housekeeping(self) -> None:
        timeout = self.cfg.serve.session_timeout_s
        while not self._stop.wait(min(1.0, timeout / 4)):
            cutoff = time.time() - timeout
            for row in self.db.all(
                "SELECT id FROM sessions WHERE finished IS NULL AND last_heartbeat < ?", (cutoff,)
            ):
                log.info("session %s sent no heartbeat for %g s: finished", row["id"], timeout)
                try:
                    self.finish_session(row["id"], "expired")
                except Exception:  # shutting down
                    log.debug("could not expire session %s", row["id"], exc_info=True)
            self.futures.sweep()

    def slots(self) -> tuple[int, int]:
        used = len(self.backend.used_slots())
        return used, self.trainer.num_slots - used
