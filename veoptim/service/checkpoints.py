"""A tenant's checkpoints: saved from a model's slot, loaded into one, deleted, and a
weights-only checkpoint's PEFT adapter handed out for download.

A checkpoint is published by the slot store (``save_slot``) under a server-made entry
name, then recorded under the client's ``tinker://`` name (so after a crash a recorded
checkpoint is always complete); it is loaded through ``load_slot`` with all of its
validation. Deleting forgets the record at once and removes the entry on the worker,
manifest first; a sampler of a deleted (or overwritten) checkpoint ends with a clear
error. The store entries no record names (a save killed before it was recorded) are
removed when the server starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tinker import types

from veoptim.errors import VeoptimError
from veoptim.service import paths
from veoptim.service.backend import Backend
from veoptim.service.db import CheckpointKind, Database
from veoptim.service.engine import Engine, Model, Op
from veoptim.service.errors import NotFound, ServiceError
from veoptim.service.futures import queued
from veoptim.service.metrics import MetricsLog
from veoptim.service.ranks import ServedTrainer
from veoptim.service.slots import Slots

log = logging.getLogger("veoptim.service")
#: The files of a weights-only checkpoint's PEFT export that a tenant downloads.
DOWNLOADS = ("adapter_config.json", "adapter_model.safetensors")


@contextmanager
def loading(ref: paths.CheckpointRef) -> Iterator[None]:
    """A refused load as the tenant should read it: which of its checkpoints, and why."""
    try:
        yield
    except VeoptimError as exc:
        raise ServiceError(f"path: loading {ref.path} failed: {exc}") from exc


class Checkpoints:
    def __init__(self, trainer: ServedTrainer, database: Database, engine: Engine, slots: Slots,
                 backend: Backend, metrics: MetricsLog) -> None:  # fmt: skip
        self.trainer, self.db, self.engine, self.slots = trainer, database, engine, slots
        self.backend, self.metrics = backend, metrics

    # ------------------------------------------------------------------ save
    def submit_save(self, model: Model, seq_id: int, kind: CheckpointKind, name: str | None,
                    overwrite: bool, sampling_seq: int | None, key: str) -> dict[str, Any]:  # fmt: skip
        future = self.engine.submit(
            model.tenant_id, model, seq_id, "save_weights",
            lambda: self.prepare_save(model, name, seq_id, kind, overwrite, sampling_seq), key,
        )  # fmt: skip
        return queued(future, model.id)

    def prepare_save(self, model: Model, name: str | None, seq_id: int, kind: CheckpointKind,
                     overwrite: bool, sampling_seq: int | None = None) -> Op:  # fmt: skip
        """A save of the model's slot: ``training`` (adapter, optimizer state, schedule) or
        weights-only (the wire's ``sampler``), with its PEFT export. One without a name
        (``save_weights_and_get_sampling_client``) is named ``ephemeral_<seq_id>`` and
        creates sampling session ``sampling_seq`` of it."""
        if kind == CheckpointKind.WEIGHTS_ONLY and name is None:
            if sampling_seq is None:
                raise ServiceError(
                    "path or sampling_session_seq_id is required: a sampler save without a name "
                    "creates a sampling session (got sampling_session_seq_id=None)."
                )
            name = f"ephemeral_{seq_id:06d}"
        else:
            sampling_seq = None
        name = f"seq{seq_id:06d}" if name is None else paths.check_name(name)
        ref = paths.CheckpointRef(model.id, kind, name)
        return Op("save_weights", None, run=lambda: self._save(model, ref, overwrite, sampling_seq))

    def _save(self, model: Model, ref: paths.CheckpointRef, overwrite: bool,
              sampling_seq: int | None) -> dict[str, Any]:  # fmt: skip
        """Worker: publish, export (weights-only), record, then drop what it replaced."""
        slot = self.backend.ready(model)
        old = self.db.checkpoint(model.tenant_id, ref.run_id, ref.kind, ref.name)
        if old is not None and not overwrite:
            raise ServiceError(
                f"path: checkpoint {ref.path} already exists; save under another name or with "
                "overwrite=True."
            )
        store_ref = paths.new_store_ref()
        version = self.trainer.save_slot(
            slot, store_ref, with_optimizer=ref.kind == CheckpointKind.TRAINING
        )
        try:
            if ref.kind == CheckpointKind.WEIGHTS_ONLY:  # what plain transformers + peft load
                self.trainer.export_slot(slot, store_ref)
            size = sum(p.stat().st_size for p in Path(version).rglob("*") if p.is_file())
            self.db.record_checkpoint(model.tenant_id, ref.run_id, ref.kind, ref.name, store_ref,
                                      size)  # fmt: skip
        except Exception:
            self.trainer.delete_checkpoint(store_ref)
            raise
        if old is not None:
            self.remove_entry(old.store_ref)
        self.metrics.write(model.id, model.tenant_id, slot, "save_weights", path=ref.path)
        segment = (
            "save_weights" if ref.kind == CheckpointKind.TRAINING else "save_weights_for_sampler"
        )
        result: dict[str, Any] = {"path": ref.path, "type": segment}
        if sampling_seq is not None:
            sid = paths.sampler_id(model.session_id, sampling_seq)
            if not self.db.add_sampler(model.tenant_id, sid, model.session_id,
                                       self.backend.served.name, ref.path, store_ref):  # fmt: skip
                raise ServiceError(
                    f"sampling_session_seq_id {sampling_seq} was already used in this session."
                )
            result["sampling_session_id"] = sid
        return result

    def submit_save_external(self, model: Model, seq_id: int, request: types.SaveWeightsExternalRequest,
                             key: str) -> dict[str, Any]:  # fmt: skip
        """``save_weights_external``: the slot's PEFT adapter as
        ``tinker://{run}/external_weights/{name}``, to download (never loaded)."""

        def prepare() -> Op:
            if request.age_encryption_recipients:
                raise ServiceError("age_encryption_recipients is not supported by this server.")
            ref = paths.CheckpointRef(
                model.id, CheckpointKind.EXTERNAL, paths.check_name(request.path)
            )
            return Op("save_weights", None, run=lambda: self._save_external(model, ref))

        future = self.engine.submit(model.tenant_id, model, seq_id, "save_weights", prepare, key)
        return queued(future, model.id)

    def _save_external(self, model: Model, ref: paths.CheckpointRef) -> dict[str, Any]:
        slot = self.backend.ready(model)
        if self.db.checkpoint(model.tenant_id, ref.run_id, ref.kind, ref.name) is not None:
            raise ServiceError(
                f"path: checkpoint {ref.path} already exists; save under another name."
            )
        store_ref = paths.new_store_ref()
        try:
            directory = self.trainer.export_slot(slot, store_ref)
            size = sum(
                p.stat().st_size for p in Path(directory).resolve().rglob("*") if p.is_file()
            )
            self.db.record_checkpoint(model.tenant_id, ref.run_id, ref.kind, ref.name, store_ref,
                                      size)  # fmt: skip
        except Exception:
            self.trainer.delete_checkpoint(store_ref)
            raise
        self.metrics.write(model.id, model.tenant_id, slot, "save_weights", path=ref.path)
        return {"path": ref.path, "size_bytes": size, "type": "save_weights_external"}

    # ------------------------------------------------------------------ load
    def submit_load(self, model: Model, seq_id: int, path: str, optimizer: bool,
                    key: str) -> dict[str, Any]:  # fmt: skip
        """``load_state[_with_optimizer]`` into the model's own slot."""

        def prepare() -> Op:
            ref = paths.parse(path)

            def run() -> dict[str, Any]:
                slot = self.backend.ready(model, partly_written=True)  # a load may repair it
                record = paths.find(self.db, model.tenant_id, ref)
                with loading(ref):
                    self.trainer.load_slot(slot, record.store_ref, load_optimizer=optimizer)
                self.metrics.write(model.id, model.tenant_id, slot, "load_weights", path=ref.path,
                                   optimizer=optimizer)  # fmt: skip
                return {"path": ref.path, "model_id": model.id, "type": "load_weights"}

            return Op("load_weights", None, run=run)

        future = self.engine.submit(model.tenant_id, model, seq_id, "load_weights", prepare, key)
        return queued(future, model.id)

    def submit_create_by_load(self, tenant_id: int, session_id: str,
                              request: types.LoadWeightsRequest) -> dict[str, Any]:  # fmt: skip
        """``create_training_client_from_state[_with_optimizer]``: a new model (id
        ``{session_id}:train:{model_seq_id}``) loaded from a checkpoint into a free slot."""
        ref = paths.parse(request.path)
        self.backend.served.check_name(request.base_model)
        if request.model_seq_id is None:
            raise ServiceError(
                "model_seq_id is required with session_id (a model created by a load)."
            )
        model = self.backend.new_model(tenant_id, session_id, request.model_seq_id)

        def run() -> dict[str, Any]:
            record = paths.find(self.db, tenant_id, ref)
            with loading(ref):
                slot = self.slots.load(model.id, record.store_ref, request.optimizer)
            self.backend.created(model, slot, self.db.run_rank(tenant_id, ref.run_id),
                                 request.user_metadata)  # fmt: skip
            log.info("model %s loaded from %s", model.id, ref.path)
            return {"path": ref.path, "model_id": model.id, "type": "load_weights"}

        return self.backend.submit_creation(model, "load_weights", run)

    # ------------------------------------------------------------------ delete
    def delete(self, tenant_id: int, run_id: str, checkpoint_id: str) -> None:
        """Forget the tenant's checkpoint now (it is no longer listed nor loadable); its
        store entry and export are removed on the worker, in order with the requests that
        may still read them."""
        ref = paths.parse_checkpoint_id(run_id, checkpoint_id)
        self.engine.check_open()
        store_ref = self.db.delete_checkpoint(tenant_id, ref.run_id, ref.kind, ref.name)
        if store_ref is None:
            raise NotFound(f"checkpoint {ref.path} was not found.")
        self._on_worker(tenant_id, "delete_checkpoint", lambda: self.remove_entry(store_ref))

    def remove_entry(self, store_ref: str) -> None:
        """Worker: free the snapshot slot of ``store_ref`` and delete its store entry and
        export (manifest first)."""
        self.slots.drop_snapshot(store_ref)
        self.trainer.delete_checkpoint(store_ref)

    def prune_unrecorded(self) -> list[str]:
        """At start: delete the store entries no checkpoint record names."""
        gone = self.trainer.prune_checkpoints(self.db.recorded_store_refs())
        if gone:
            log.warning("removed %d slot-store entries no checkpoint record names (saves "
                        "interrupted by a crash)", len(gone))  # fmt: skip
        return gone

    def _on_worker(self, tenant_id: int, kind: str, action: Callable[[], None]) -> None:
        def run() -> dict[str, Any]:
            action()
            return {}

        self.engine.submit(tenant_id, None, None, kind, lambda: Op(kind, None, run=run))

    # ------------------------------------------------------------------ downloads
    def export_dir(self, store_ref: str) -> Path:
        """Where the PEFT export of weights-only checkpoint entry ``store_ref`` is."""
        return self.trainer.export_dir(paths.check_name(store_ref))

    def downloadable(self, tenant_id: int, run_id: str, checkpoint_id: str) -> Path:
        """The PEFT adapter directory (its files are :data:`DOWNLOADS`) of the tenant's
        external or weights-only checkpoint; ``external_weights/<name>`` also names the
        export of weights-only checkpoint ``<name>``. A training checkpoint has none."""
        ref = paths.parse_checkpoint_id(run_id, checkpoint_id)
        if ref.kind == CheckpointKind.TRAINING:
            raise ServiceError(
                f"checkpoint_id: {ref.path} is a training checkpoint, which has no PEFT export; "
                "save_weights_external (or save_weights_for_sampler) exports the adapter."
            )
        record = self.db.checkpoint(tenant_id, ref.run_id, ref.kind, ref.name)
        if record is None and ref.kind == CheckpointKind.EXTERNAL:
            record = self.db.checkpoint(
                tenant_id, ref.run_id, CheckpointKind.WEIGHTS_ONLY, ref.name
            )
        if record is None:
            raise NotFound(f"checkpoint_id: checkpoint {ref.path} was not found.")
        directory = self.export_dir(record.store_ref)
        if not directory.is_dir():
            raise NotFound(f"checkpoint_id: {ref.path} has no PEFT export on this server.")
        return directory
