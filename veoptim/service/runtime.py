"""The service's parts put together, one per server (rank 0 of a torchrun job; the other
ranks follow its trainer calls, ``veoptim/service/ranks.py``).

The layers, each calling only the ones below it: the HTTP routes (``routes/``) → the
engine (the worker and each model's ``seq_id`` order, ``engine.py``) → what a request
does (``backend.py`` training, ``checkpoints.py``, ``sampling.py``, ``sessions.py``,
``catalog.py``) → the slots (``slots.py``, the one owner of slot occupancy, over the
trainer of ``ranks.py``). All of them keep their records through the tenant-scoped data
layer (``db.py``). Start-up recovers: pending futures fail, no model holds a slot, and
store entries no checkpoint record names are removed.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from veoptim.service.auth import KeyTable, read_keys_file
from veoptim.service.backend import Backend
from veoptim.service.catalog import Catalog
from veoptim.service.checkpoints import Checkpoints
from veoptim.service.config import ServeConfig
from veoptim.service.db import DB_FILE, Database
from veoptim.service.engine import Engine, Op, Slices
from veoptim.service.errors import Redactor
from veoptim.service.futures import FutureTable
from veoptim.service.hub_cache import install_tokenizer
from veoptim.service.links import Links
from veoptim.service.metrics import MetricsLog
from veoptim.service.ranks import ServedTrainer
from veoptim.service.sampling import SampleBatch, Samplers
from veoptim.service.served import ServedModel
from veoptim.service.sessions import Sessions
from veoptim.service.slots import Slots
from veoptim.slots import SlotTrainer

log = logging.getLogger("veoptim.service")
RESTARTED = "the server restarted before this request finished; submit it again."
#: Threads that run the HTTP side's blocking calls (the database, queueing a request).
IO_THREADS = 8


class Service:
    def __init__(self, cfg: ServeConfig, served: ServedTrainer | None = None) -> None:
        """``served``: the trainer of every rank of a torchrun job (built on all of them);
        by default one built from ``cfg`` in this process."""
        cfg.check_serve_keys()
        self.cfg = cfg
        run_dir = Path(cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.db = self._open_database(run_dir / DB_FILE)
        self.keys = KeyTable(self.db.tenant_keys, self.db.tenant_by_hash)
        if served is None:
            served = ServedTrainer(SlotTrainer.from_config(cfg), cfg.serve.rank_timeout_s)
        self.served, self.trainer = served, served.trainer
        self.redact = Redactor([run_dir, cfg.checkpoint.root_dir(run_dir)])
        self.futures = FutureTable(self.db, cfg.serve.max_futures_per_tenant, self.redact)
        self.engine = Engine(self.futures, batch_tenants=cfg.serve.batch_tenants,
                             gap_timeout_s=cfg.serve.seq_gap_timeout_s, run_batch=self.run_batch,
                             schedule=cfg.serve.schedule,
                             max_batch_rows=cfg.serve.max_batch_rows)  # fmt: skip
        self.slots = Slots(served)
        self.base = ServedModel.of(cfg, served.trainer)
        metrics = MetricsLog(run_dir / "metrics.jsonl")
        self.backend = Backend(served, self.db, self.engine, self.slots, self.base, metrics,
                               cfg.serve.max_datums)  # fmt: skip
        self.checkpoints = Checkpoints(served, self.db, self.engine, self.slots, self.backend,
                                       metrics)  # fmt: skip
        self.samplers = Samplers(served, self.db, self.engine, self.slots, self.base, metrics,
                                 cfg.serve.slice_s)  # fmt: skip
        self.sessions = Sessions(self.db, self.engine, self.backend, self.samplers)
        self.catalog = Catalog(self.db)
        self.links = Links()
        self.io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="veoptim-service-io")
        self.checkpoints.prune_unrecorded()
        self._install_tokenizer()
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(target=self._housekeeping, daemon=True,
                                             name="veoptim-service-housekeeping")  # fmt: skip

    def _open_database(self, path: Path) -> Database:
        """The database, recovered from the last shutdown, with the keys file's tenants."""
        db = Database(path)
        failed = db.recover(RESTARTED)
        if failed:
            log.warning(
                "%d requests pending at the last shutdown now answer a server error", failed
            )
        if self.cfg.serve.keys_file:
            for name, digest in read_keys_file(self.cfg.serve.keys_file):
                db.add_tenant(name, digest)
        return db

    def _install_tokenizer(self) -> None:
        """The served tokenizer in the Hugging Face cache (``serve.tokenizer_cache``);
        best-effort: a server that cannot write there serves all the same."""
        cache = self.cfg.serve.tokenizer_cache
        if not cache:
            return
        if cache == "auto":
            from huggingface_hub.constants import HF_HUB_CACHE

            cache = HF_HUB_CACHE
        try:
            install_tokenizer(Path(self.base.tokenizer_dir), self.base.name, Path(cache))
        except OSError as exc:
            log.warning("could not install the served tokenizer in %s: %s", cache, exc)

    def start(self, worker_thread: bool = True) -> None:
        """Start housekeeping and (with ``worker_thread``) the worker on its own thread;
        without, the caller runs ``engine.run()`` itself (the server's main thread)."""
        if worker_thread:
            self.engine.start()
        self._housekeeper.start()
        log.info("serving %s: %d slots of rank <= %d; state in %s", self.base.name,
                 self.slots.num_slots, self.cfg.lora.r, self.db.path)  # fmt: skip

    def stop(self) -> None:
        """Drain: refuse new requests, finish the runnable ones (``serve.drain_timeout_s``),
        fail the rest, close the database."""
        self._stop.set()
        self.engine.stop(self.cfg.serve.drain_timeout_s)
        self._housekeeper.join(5)
        self.io.shutdown(wait=True, cancel_futures=True)
        self.served.stop_followers()
        self.db.close()

    def run_batch(self, ops: list[Op]) -> list[Any] | Slices:
        """The worker's batches: sampling requests (run a slice at a time), or
        forward_backward requests."""
        if isinstance(ops[0].batch, SampleBatch):
            return self.samplers.run(ops)
        return self.backend.forward_backward(ops)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of ``healthz``: 503 while draining or after a lost rank."""
        used = self.slots.training()
        body: dict[str, Any] = {"status": "ok", "slots_used": used,
                                "slots_free": self.slots.num_slots - used,
                                "ranks": self.served.world}  # fmt: skip
        if self.served.lost:
            body.update(status="lost_rank", error=self.served.lost)
        elif self.engine.stopping:
            body["status"] = "draining"
        return (200 if body["status"] == "ok" else 503), body

    def _housekeeping(self) -> None:
        timeout = self.cfg.serve.session_timeout_s
        while not self._stop.wait(min(1.0, timeout / 4)):
            self.sessions.expire(timeout, time.time())
            self.futures.sweep()
            try:
                self.keys.refresh()
            except Exception:  # the database closed: shutting down
                log.debug("could not read the keys again", exc_info=True)
