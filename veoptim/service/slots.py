"""Which slot holds what: the one owner of slot occupancy in the service.

A slot holds a training model's adapter (one model, until it is unloaded) or a sampler
snapshot: a published checkpoint loaded weights-only, kept as a cache for the samplers
of that checkpoint. Training models come first: a model that needs a slot takes a free
one, else the one of the least recently used snapshot. A snapshot takes a free slot or
another snapshot's, never a training model's. Every change of occupancy goes through
this class, which makes the trainer calls (create, load, release) itself: worker thread
only. ``healthz`` reads the counts from the HTTP thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from typing import Any

from veoptim.service.errors import ServiceError
from veoptim.service.ranks import ServedTrainer

log = logging.getLogger("veoptim.service")


class Slots:
    def __init__(self, trainer: ServedTrainer) -> None:
        self.trainer = trainer
        self.num_slots = int(trainer.num_slots)
        self._lock = threading.Lock()
        self._models: dict[str, int] = {}  # model id -> its slot
        self._snapshots: dict[str, int] = {}  # store entry -> the slot it is loaded in
        self._last_use: dict[int, float] = {}  # snapshot slot -> when it last sampled

    # ------------------------------------------------------------------ reading
    def of_model(self, model_id: str) -> int | None:
        with self._lock:
            return self._models.get(model_id)

    def training(self) -> int:
        """How many slots training models hold (what ``healthz`` calls used)."""
        with self._lock:
            return len(self._models)

    def snapshots(self) -> dict[str, int]:
        """Store entry -> slot of every cached snapshot."""
        with self._lock:
            return dict(self._snapshots)

    def usable(self, model_id: str, partly_written: bool = False) -> int:
        """The model's slot, refused if it holds none or (unless ``partly_written``) a
        failed load left it partly written."""
        slot = self.of_model(model_id)
        if slot is None:
            raise ServiceError(f"model_id {model_id} holds no slot (it was unloaded).")
        if not self.trainer.holds(slot) or (
            self.trainer.partly_written(slot) and not partly_written
        ):
            raise ServiceError(
                f"model_id {model_id}: its slot was left partly written by a failed load; load "
                "a checkpoint into it again before training it."
            )
        return slot

    # ------------------------------------------------------------------ training models
    def create(self, model_id: str, hyper: dict[str, Any]) -> int:
        """A fresh adapter for a new model in a slot of its own."""
        slot = self._take(frozenset(), for_model=True)
        self.trainer.create_slot(slot, **hyper)
        with self._lock:
            self._models[model_id] = slot
        return slot

    def load(self, model_id: str, store_ref: str, optimizer: bool) -> int:
        """A new model loaded from a checkpoint into a slot of its own; a refused load
        leaves no slot taken."""
        slot = self._take(frozenset(), for_model=True)
        try:
            self.trainer.load_slot(slot, store_ref, load_optimizer=optimizer)
        except Exception:
            if self.trainer.holds(slot):
                self.trainer.release_slot(slot)
            raise
        with self._lock:
            self._models[model_id] = slot
        return slot

    def release(self, model_id: str) -> int | None:
        """Free the model's slot; the slot it held (None: none)."""
        with self._lock:
            slot = self._models.pop(model_id, None)
        if slot is not None and self.trainer.holds(slot):
            self.trainer.release_slot(slot)
        return slot

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, store_ref: str, keep: Collection[str]) -> int:
        """The slot holding snapshot ``store_ref``, loading it first (weights only, all of
        the load's validation) into a free slot or one of a snapshot not in ``keep``."""
        with self._lock:
            slot = self._snapshots.get(store_ref)
        if slot is None:
            slot = self._take(keep, for_model=False)
            try:
                self.trainer.load_slot(slot, store_ref, load_optimizer=False)
            except Exception:
                if self.trainer.holds(slot):
                    self.trainer.release_slot(slot)
                raise
            with self._lock:
                self._snapshots[store_ref] = slot
            log.info("sampler snapshot %s loaded into slot %d", store_ref, slot)
        with self._lock:
            self._last_use[slot] = time.monotonic()
        return slot

    def drop_snapshot(self, store_ref: str) -> None:
        """Free the slot of snapshot ``store_ref`` if it is cached."""
        with self._lock:
            slot = self._snapshots.pop(store_ref, None)
            if slot is not None:
                self._last_use.pop(slot, None)
        if slot is not None:
            if self.trainer.holds(slot):
                self.trainer.release_slot(slot)
            log.info("sampler snapshot %s left slot %d", store_ref, slot)

    def keep_snapshots(self, live: Collection[str]) -> None:
        """Free the slots of the cached snapshots not in ``live``."""
        for store_ref in [ref for ref in self.snapshots() if ref not in live]:
            self.drop_snapshot(store_ref)

    # ------------------------------------------------------------------ taking a slot
    def _take(self, keep: Collection[str], *, for_model: bool) -> int:
        """A slot nothing holds, else the least recently used snapshot's (not in ``keep``)."""
        with self._lock:
            busy = {*self._models.values(), *self._snapshots.values()}
            free = [s for s in range(self.num_slots) if s not in busy]
            evictable = sorted(
                (self._last_use.get(slot, 0.0), ref)
                for ref, slot in self._snapshots.items()
                if ref not in keep
            )
        if free:
            return free[0]
        if not evictable:
            raise ServiceError(self._full_message(for_model))
        ref = evictable[0][1]
        with self._lock:
            slot = self._snapshots[ref]
        self.drop_snapshot(ref)
        return slot

    def _full_message(self, for_model: bool) -> str:
        n = self.num_slots
        if for_model:
            return (
                f"all {n} slots are in use (lora.num_slots={n}); unload a model or finish a "
                "session, or start the server with more lora.num_slots."
            )
        return (
            f"all {n} slots are in use (lora.num_slots={n}) by training models and the "
            "snapshots this batch samples; unload a model or start the server with more "
            "lora.num_slots."
        )
