"""What each request does to the :class:`SlotTrainer`: a model is one slot.

Every ``prepare_*`` method validates a request and returns the :class:`Op` the worker
will run (a refusal is a :class:`ServiceError` naming the field, before any slot is
touched); the ops' ``run`` callables and :meth:`forward_backward` run on the worker
thread only. Checkpoints are published through the slot store (``save_slot``) under a
server-made name, and loaded through ``load_slot`` with all of its validation.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veoptim.data import bundled_tokenizer_dir
from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS
from veoptim.data.tokenizer import tokenizer_source
from veoptim.lora.slots import SLOT_IDS
from veoptim.lora.slots.tokens import TARGET_TOKENS
from veoptim.service import paths
from veoptim.service.config import ServeConfig
from veoptim.service.db import Database
from veoptim.service.engine import CREATING, FAILED, READY, UNLOADED, Engine, Model, Op
from veoptim.service.errors import NotFound, ServiceError
from veoptim.service.losses import Loss, check_inputs, get_loss
from veoptim.service.ranks import ServedTrainer
from veoptim.service.sampler import SampleBatch, Samplers
from veoptim.service.wire import ForwardBackwardRequest, encode_forward_backward_output

log = logging.getLogger("veoptim.service")
#: lora_config flag -> the module names it adapts.
FAMILIES = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


class Batch:
    """One forward_backward request's rows, ready to join other models' rows."""

    def __init__(self, model: Model, loss: Loss, forward_only: bool, data: list) -> None:
        self.model, self.loss, self.forward_only, self.data = model, loss, forward_only, data

    def joins(self, other: Any) -> bool:
        return (
            isinstance(other, Batch)
            and other.loss == self.loss
            and other.forward_only == self.forward_only
            and other.model.id != self.model.id
        )


class Backend:
    def __init__(self, cfg: ServeConfig, trainer: ServedTrainer, database: Database) -> None:
        self.cfg, self.trainer, self.db = cfg, trainer, database
        self.engine: Engine  # set by the app once the engine exists
        self.base_model = cfg.serve.base_model or cfg.model.name
        directory, _ = tokenizer_source(cfg.data.tokenizer_path, cfg.model.path)
        self.tokenizer_dir = str(Path(directory or bundled_tokenizer_dir()).resolve())
        self.vocab = int(trainer.model.config.vocab_size)
        self.max_tokens = int(cfg.data.max_seq_len)
        self.arch = str(getattr(trainer.model.config, "model_type", ""))
        targets = set(cfg.lora.target_modules)
        self.families = {flag: bool(targets & set(names)) for flag, names in FAMILIES.items()}
        self.metrics_path = Path(cfg.run.dir) / "metrics.jsonl"
        self.samplers = Samplers(self)

    def run_batch(self, ops: list[Op]) -> list[Any]:
        """The worker's batches: sampling requests, or forward_backward requests."""
        if isinstance(ops[0].batch, SampleBatch):
            return self.samplers.run(ops)
        return self.forward_backward(ops)

    # ------------------------------------------------------------------ models
    def used_slots(self) -> set[int]:
        return {m.slot for m in self.engine.models.values() if m.slot is not None}

    def _free_slot(self) -> int:
        """A slot for a training model: a free one, else one a sampler snapshot gives up."""
        try:
            return self.samplers.take_slot()
        except ServiceError:
            raise ServiceError(
                f"all {self.trainer.num_slots} slots are in use (lora.num_slots="
                f"{self.trainer.num_slots}); unload a model or finish a session, or start the "
                "server with more lora.num_slots."
            ) from None

    def check_session(self, session_id: Any, tenant_id: int) -> str:
        row = self.db.one("SELECT * FROM sessions WHERE id = ? AND tenant_id = ?",
                          (str(session_id), tenant_id))  # fmt: skip
        if row is None:
            raise NotFound(f"session_id {session_id!r} is not a session of this tenant.")
        if row["finished"] is not None:
            raise ServiceError(f"session_id {session_id!r} is finished ({row['finish_reason']}).")
        return str(session_id)

    def check_base_model(self, base_model: Any, field: str = "base_model") -> None:
        if base_model is not None and base_model != self.base_model:
            raise ServiceError(
                f"{field} {base_model!r} is not served here; this server trains "
                f"[{self.base_model!r}]."
            )

    def new_model(self, tenant_id: int, session_id: str, model_seq_id: Any) -> Model:
        if not isinstance(model_seq_id, int) or model_seq_id < 0:
            raise ServiceError(f"model_seq_id must be an integer >= 0, got {model_seq_id!r}.")
        model = Model(paths.model_id(session_id, model_seq_id), tenant_id, session_id)
        if self.db.one("SELECT 1 FROM training_runs WHERE id = ?", (model.id,)):
            raise ServiceError(f"model_seq_id {model_seq_id} was already used in this session.")
        self.engine.add_model(model)
        return model

    def lora_hyper(self, lora: dict[str, Any]) -> dict[str, Any]:
        rank = lora.get("rank")
        if not isinstance(rank, int) or not 1 <= rank <= self.cfg.lora.r:
            raise ServiceError(
                f"lora_config.rank must be an integer in [1, {self.cfg.lora.r}] (lora.r, the "
                f"largest rank of this server's slots), got {rank!r}."
            )
        for flag, present in self.families.items():
            if bool(lora.get(flag, True)) != present:
                raise ServiceError(
                    f"lora_config.{flag}={bool(lora.get(flag, True))} is not available: this "
                    f"server's slots adapt lora.target_modules={list(self.cfg.lora.target_modules)} "
                    f"(train_attn={self.families['train_attn']}, train_mlp="
                    f"{self.families['train_mlp']}, train_unembed={self.families['train_unembed']})."
                )
        hyper: dict[str, Any] = {"r": rank}
        seed = lora.get("seed")
        if seed is not None:
            if not isinstance(seed, int):
                raise ServiceError(f"lora_config.seed must be an integer, got {seed!r}.")
            hyper["seed"] = seed
        return hyper

    def _record_run(self, model: Model, base_model: str, metadata: Any) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO training_runs (id, tenant_id, session_id, base_model, lora_rank, "
            "created, last_request, user_metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (model.id, model.tenant_id, model.session_id, base_model, model.rank, now, now,
             json.dumps(metadata) if metadata else None),
        )  # fmt: skip
        self.db.execute(
            "INSERT INTO models (id, slot, status, updated) VALUES (?, ?, ?, ?)",
            (model.id, model.slot, READY, now),
        )

    def prepare_create(self, model: Model, hyper: dict[str, Any], metadata: Any) -> Op:
        def run() -> dict[str, Any]:
            slot = self._free_slot()
            try:
                self.trainer.create_slot(slot, **hyper)
            except Exception as exc:
                self._mark_failed(model, str(exc))
                raise
            model.slot, model.rank, model.status = slot, hyper["r"], READY
            self._record_run(model, self.base_model, metadata)
            log.info("model %s created in slot %d (rank %d)", model.id, slot, model.rank)
            return {"model_id": model.id, "type": "create_model"}

        return Op("create_model", None, run=run)

    def prepare_create_by_load(self, model: Model, path: str, optimizer: bool,
                               metadata: Any) -> Op:  # fmt: skip
        ref = paths.parse(path)

        def run() -> dict[str, Any]:
            try:
                record = self._checkpoint(model.tenant_id, ref)
                slot = self._free_slot()
                self.trainer.load_slot(slot, record["store_ref"], load_optimizer=optimizer)
            except Exception as exc:
                self._mark_failed(model, str(exc))
                raise
            source = self.db.one("SELECT lora_rank FROM training_runs WHERE id = ?",
                                 (record["run_id"],))  # fmt: skip
            model.slot, model.status = slot, READY
            model.rank = int(source["lora_rank"]) if source else 0
            self._record_run(model, self.base_model, metadata)
            log.info("model %s loaded from %s into slot %d", model.id, ref.path, slot)
            return {"path": ref.path, "model_id": model.id, "type": "load_weights"}

        return Op("load_weights", None, run=run)

    def _mark_failed(self, model: Model, error: str) -> None:
        model.status, model.error = FAILED, error

    def prepare_unload(self, model: Model) -> Op:
        def run() -> dict[str, Any]:
            self.release(model)
            return {"model_id": model.id, "type": "unload_model"}

        return Op("unload_model", None, run=run)

    def release(self, model: Model) -> None:
        """Free the model's slot (worker thread)."""
        if model.slot is not None and model.slot in self.trainer.slots:
            self.trainer.release_slot(model.slot)
        if model.status != UNLOADED:
            log.info("model %s unloaded (slot %s freed)", model.id, model.slot)
        model.slot, model.status = None, UNLOADED
        self.db.execute("UPDATE models SET slot = NULL, status = ?, updated = ? WHERE id = ?",
                        (UNLOADED, time.time(), model.id))  # fmt: skip

    def ready(self, model: Model) -> int:
        if model.status != READY or model.slot is None:
            raise ServiceError(
                f"model_id {model.id} is {model.status}: {model.error or 'not ready'}"
            )
        self.db.execute("UPDATE training_runs SET last_request = ? WHERE id = ?",
                        (time.time(), model.id))  # fmt: skip
        return model.slot

    # ------------------------------------------------------------------ training
    def prepare_forward_backward(self, model: Model, request: ForwardBackwardRequest) -> Op:
        if model.status not in (CREATING, READY):
            raise ServiceError(f"model_id {model.id} is {model.status}.")
        loss = get_loss(request.loss_fn, request.loss_fn_config)
        data = request.data
        if not data:
            raise ServiceError("data is empty: a forward_backward needs at least one datum.")
        if len(data) > self.cfg.serve.max_datums:
            raise ServiceError(
                f"data holds {len(data)} datums, more than serve.max_datums="
                f"{self.cfg.serve.max_datums} per request."
            )
        for i, datum in enumerate(data):
            n = datum.tokens.shape[0]
            if n == 0:
                raise ServiceError(f"data[{i}].model_input has no tokens.")
            if n > self.max_tokens:
                raise ServiceError(
                    f"data[{i}].model_input has {n} tokens, more than the model's context of "
                    f"{self.max_tokens} (data.max_seq_len)."
                )
            if datum.tokens.min() < 0 or datum.tokens.max() >= self.vocab:
                raise ServiceError(
                    f"data[{i}].model_input holds token ids outside the vocabulary [0, {self.vocab})."
                )
            check_inputs(loss, i, datum.tokens, datum.inputs, self.vocab)
        kind = "forward" if request.forward_only else "forward_backward"
        return Op(kind, None, batch=Batch(model, loss, request.forward_only, data))

    def forward_backward(self, ops: list[Op]) -> list[Any]:
        """Run the batches of ``ops`` (one per model, same loss and mode) as one slot batch."""
        parts: list[Batch] = [op.batch for op in ops]
        results: list[Any] = [None] * len(parts)
        live = []
        for k, part in enumerate(parts):  # a part that cannot run fails alone, not the batch
            try:
                slot = self.ready(part.model)
                state = self.trainer.slots.get(slot)
                if state is None or state.invalid:
                    raise ServiceError(
                        f"model_id {part.model.id}: its slot was left partly written by a failed "
                        "load; load a checkpoint into it again before training it."
                    )
                live.append((k, part, slot))
            except ServiceError as exc:
                results[k] = exc
        if not live:
            return results
        rows = [(slot, d) for _, part, slot in live for d in part.data]
        began = time.perf_counter()
        batch = build_batch(rows, parts[0].loss)
        out = self.trainer.forward_tokens(batch, parts[0].loss, backward=not parts[0].forward_only)
        start = 0
        for k, part, slot in live:
            outputs, loss_sum = [], 0.0
            for j, datum in enumerate(part.data, start):
                n = datum.tokens.shape[0]
                outputs.append({"logprobs": out.logprobs[j, :n].numpy()})
                loss_sum += float(out.row_losses[j])
            start += len(part.data)
            results[k] = encode_forward_backward_output(outputs, {"loss:sum": loss_sum})
            self._metric(part.model, slot, "forward" if part.forward_only else "forward_backward",
                         loss_sum=loss_sum, datums=len(part.data), rows_in_batch=len(rows),
                         seconds=round(time.perf_counter() - began, 6))  # fmt: skip
        return results

    def prepare_optim_step(self, model: Model, adam: dict[str, Any]) -> Op:
        values = {}
        for key, default in (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95),
                             ("eps", 1e-12), ("weight_decay", 0.0), ("grad_clip_norm", 0.0)):  # fmt: skip
            value = adam.get(key, default)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not np.isfinite(value)
            ):
                raise ServiceError(f"adam_params.{key} must be a finite number, got {value!r}.")
            values[key] = float(value)
        for key in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            if values[key] < 0:
                raise ServiceError(f"adam_params.{key} must be >= 0, got {values[key]}.")
        for key in ("beta1", "beta2"):
            if not 0 <= values[key] < 1:
                raise ServiceError(f"adam_params.{key} must be in [0, 1), got {values[key]}.")

        def run() -> dict[str, Any]:
            slot = self.ready(model)
            began = time.perf_counter()
            result = self.trainer.optim_step(
                slot, values["grad_clip_norm"], lr=values["learning_rate"],
                betas=(values["beta1"], values["beta2"]), eps=values["eps"],
                weight_decay=values["weight_decay"],
            )  # fmt: skip
            self._metric(model, slot, "optim_step", **result,
                         seconds=round(time.perf_counter() - began, 6))  # fmt: skip
            return {"metrics": {"grad_norm:mean": result["grad_norm"],
                                "learning_rate:mean": result["lr"], "step:max": result["step"]}}  # fmt: skip

        return Op("optim_step", None, run=run)

    # ------------------------------------------------------------------ checkpoints
    def prepare_save(self, model: Model, name: Any, seq_id: int, kind: str,
                     overwrite: bool, sampling_seq: Any = None) -> Op:  # fmt: skip
        """A save of the model's slot: ``training`` (adapter, optimizer state, schedule) or
        ``sampler`` (weights only, plus its PEFT export). A sampler save without a name
        (``save_weights_and_get_sampling_client``) is named ``ephemeral_<seq_id>`` and
        creates sampling session ``sampling_seq`` of it."""
        if kind == paths.SAMPLER and name is None:
            if isinstance(sampling_seq, bool) or not isinstance(sampling_seq, int):
                raise ServiceError(
                    "path or sampling_session_seq_id is required: a sampler save without a name "
                    f"creates a sampling session (got sampling_session_seq_id={sampling_seq!r})."
                )
            name = f"ephemeral_{seq_id:06d}"
        else:
            sampling_seq = None
        name = f"seq{seq_id:06d}" if name is None else paths.check_name(name)
        ref = paths.CheckpointRef(model.id, kind, name)

        def run() -> dict[str, Any]:
            slot = self.ready(model)
            old = self.db.one(
                "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                (ref.run_id, kind, name),
            )
            if old is not None and not overwrite:
                raise ServiceError(
                    f"path: checkpoint {ref.path} already exists; save under another name or "
                    "with overwrite=True."
                )
            store_name = f"c{uuid.uuid4().hex[:20]}"
            version = self.trainer.save_slot(
                slot, store_name, with_optimizer=kind == paths.TRAINING
            )
            if kind == paths.SAMPLER:  # the PEFT adapter a plain transformers + peft loads
                try:
                    export = self.trainer.export_slot(slot, store_name)
                except Exception:
                    self.remove_store_entry(store_name)
                    raise
                log.info("sampler weights %s exported as %s", ref.path, export)
            size = sum(p.stat().st_size for p in Path(version).rglob("*") if p.is_file())
            self.db.execute(
                "INSERT INTO checkpoints (tenant_id, run_id, kind, name, store_ref, size_bytes, "
                "created) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, kind, name) DO UPDATE "
                "SET store_ref = excluded.store_ref, size_bytes = excluded.size_bytes, "
                "created = excluded.created",
                (model.tenant_id, ref.run_id, kind, name, store_name, size, time.time()),
            )
            if old is not None:
                self.remove_store_entry(old["store_ref"])
            self._metric(model, slot, "save_weights", path=ref.path)
            segment = "save_weights" if kind == paths.TRAINING else "save_weights_for_sampler"
            result = {"path": ref.path, "type": segment}
            if sampling_seq is not None:
                result["sampling_session_id"] = self.samplers.record(
                    model.tenant_id, model.session_id, sampling_seq, ref.path, store_name
                )
            return result

        return Op("save_weights", None, run=run)

    def prepare_load(self, model: Model, path: str, optimizer: bool) -> Op:
        ref = paths.parse(path)

        def run() -> dict[str, Any]:
            slot = self.ready(model)
            record = self._checkpoint(model.tenant_id, ref)
            self.trainer.load_slot(slot, record["store_ref"], load_optimizer=optimizer)
            self._metric(model, slot, "load_weights", path=ref.path, optimizer=optimizer)
            return {"path": ref.path, "model_id": model.id, "type": "load_weights"}

        return Op("load_weights", None, run=run)

    def _checkpoint(self, tenant_id: int, ref: paths.CheckpointRef) -> Any:
        record = self.db.one(
            "SELECT * FROM checkpoints WHERE tenant_id = ? AND run_id = ? AND kind = ? AND name = ?",
            (tenant_id, ref.run_id, ref.kind, ref.name),
        )
        if record is None:
            raise NotFound(f"path: checkpoint {ref.path} was not found.")
        return record

    def remove_store_entry(self, store_ref: str) -> None:
        """Delete a checkpoint's directory from the slot store (a server-made name), and
        its PEFT export when it has one."""
        name = paths.check_name(store_ref)
        for link in (self.trainer.store.root / name, self.trainer.export_dir(name)):
            root = link.parent
            target = link.resolve()
            if not is_within(target, root.resolve()):
                continue
            if link.is_symlink():
                link.unlink()
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)

    def export_dir(self, store_ref: str) -> Path:
        """Where the PEFT export of sampler checkpoint ``store_ref`` is."""
        return self.trainer.export_dir(paths.check_name(store_ref))

    # ------------------------------------------------------------------ metrics
    def _metric(self, model: Model, slot: int, op: str, **values: Any) -> None:
        self.write_metric(model.id, model.tenant_id, slot, op, **values)

    def write_metric(self, model_id: str, tenant_id: int, slot: int | None, op: str,
                     **values: Any) -> None:  # fmt: skip
        line = {"time": round(time.time(), 3), "model": model_id, "tenant": tenant_id,
                "slot": slot, "op": op, **values}  # fmt: skip
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def is_within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def build_batch(rows: list[tuple[int, Any]], loss: Loss) -> dict[str, torch.Tensor]:
    """Rows (slot, datum) right-padded to the longest: input ids and targets with 0,
    attention mask 0 and float inputs 0 there (so the padding adds exact zeros)."""
    length = max(d.tokens.shape[0] for _, d in rows)
    batch = {
        INPUT_IDS: torch.zeros(len(rows), length, dtype=torch.long),
        ATTENTION_MASK: torch.zeros(len(rows), length, dtype=torch.long),
        SLOT_IDS: torch.tensor([slot for slot, _ in rows]),
    }
    for name, kind in loss.inputs.items():
        dtype = torch.long if kind == "i" else torch.float32
        batch[name] = torch.zeros(len(rows), length, dtype=dtype)
    for i, (_, datum) in enumerate(rows):
        n = datum.tokens.shape[0]
        batch[INPUT_IDS][i, :n] = torch.tensor(datum.tokens)
        batch[ATTENTION_MASK][i, :n] = 1
        for name in loss.inputs:
            batch[name][i, :n] = torch.tensor(datum.inputs[name])
    assert TARGET_TOKENS in batch
    return batch
