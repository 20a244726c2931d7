"""What a training request does to its model: a model is one slot.

Every ``submit_*`` method validates a request and queues the :class:`Op` the worker will
run, in the model's ``seq_id`` order (a refusal is a :class:`ServiceError` naming the
field, before any slot is touched, and still uses its ``seq_id``); the ops' ``run``
callables and :meth:`Backend.forward_backward` run on the worker thread only. Which slot
a model holds is :class:`~veoptim.service.slots.Slots`' business; checkpoints are
:mod:`veoptim.service.checkpoints`'.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from tinker import types

from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS
from veoptim.service import paths
from veoptim.service.db import Database, ModelStatus
from veoptim.service.engine import Engine, Model, Op
from veoptim.service.errors import ServiceError
from veoptim.service.futures import queued
from veoptim.service.losses import Loss, check_inputs, get_loss
from veoptim.service.metrics import MetricsLog
from veoptim.service.ranks import ServedTrainer
from veoptim.service.served import ServedModel
from veoptim.service.slots import Slots
from veoptim.service.wire import Datum, ForwardBackwardRequest, encode_forward_backward_output
from veoptim.slots import SLOT_IDS, TARGET_TOKENS

log = logging.getLogger("veoptim.service")
#: torch.Generator.manual_seed's range.
SEED_RANGE = (-(2**63), 2**64)
#: AdamParams field -> (default, lowest, highest allowed; None: no bound).
ADAM = {"learning_rate": (1e-4, 0.0, None), "beta1": (0.9, 0.0, 1.0), "beta2": (0.95, 0.0, 1.0),
        "eps": (1e-12, 0.0, None), "weight_decay": (0.0, 0.0, None),
        "grad_clip_norm": (0.0, 0.0, None)}  # fmt: skip


class Batch:
    """One forward_backward (or forward) request's rows, ready to join other models' rows
    of the same loss: a forward beside a forward_backward trains nothing of its model."""

    def __init__(self, model: Model, loss: Loss, forward_only: bool, data: list[Datum]) -> None:
        self.model, self.loss, self.forward_only, self.data = model, loss, forward_only, data

    @property
    def rows(self) -> int:
        return len(self.data)

    def joins(self, other: Any) -> bool:
        return (
            isinstance(other, Batch) and other.loss == self.loss and other.model.id != self.model.id
        )


class Backend:
    def __init__(self, trainer: ServedTrainer, database: Database, engine: Engine, slots: Slots,
                 served: ServedModel, metrics: MetricsLog, max_datums: int) -> None:  # fmt: skip
        self.trainer, self.db, self.engine, self.slots = trainer, database, engine, slots
        self.served, self.metrics, self.max_datums = served, metrics, max_datums

    # ------------------------------------------------------------------ models
    def new_model(self, tenant_id: int, session_id: str, model_seq_id: int) -> Model:
        """A model about to be created in the tenant's session (seq_id 0 is its creation)."""
        if model_seq_id < 0:
            raise ServiceError(f"model_seq_id must be an integer >= 0, got {model_seq_id!r}.")
        model = Model(paths.model_id(session_id, model_seq_id), tenant_id, session_id)
        if self.db.run_exists(tenant_id, model.id):
            raise ServiceError(f"model_seq_id {model_seq_id} was already used in this session.")
        self.engine.add_model(model)
        return model

    def lora_hyper(self, lora: types.LoraConfig | None) -> dict[str, Any]:
        """The slot hyperparameters of a ``lora_config`` (refused naming the field)."""
        if lora is None:
            raise ServiceError("lora_config is required: this server trains LoRA adapters only.")
        if not 1 <= lora.rank <= self.served.max_rank:
            raise ServiceError(
                f"lora_config.rank must be an integer in [1, {self.served.max_rank}] (lora.r, the "
                f"largest rank of this server's slots), got {lora.rank!r}."
            )
        families = self.served.families
        for flag, present in families.items():
            if bool(getattr(lora, flag)) != present:
                raise ServiceError(
                    f"lora_config.{flag}={getattr(lora, flag)} is not available: this server's "
                    f"slots adapt lora.target_modules={list(self.served.target_modules)} "
                    f"(train_attn={families['train_attn']}, train_mlp={families['train_mlp']}, "
                    f"train_unembed={families['train_unembed']})."
                )
        hyper: dict[str, Any] = {"r": lora.rank}
        if lora.seed is not None:
            low, high = SEED_RANGE
            if not low <= lora.seed < high:
                raise ServiceError(
                    f"lora_config.seed must be an integer in [-2**63, 2**64), got {lora.seed}."
                )
            hyper["seed"] = lora.seed
        return hyper

    def submit_create(self, tenant_id: int, session_id: str, request: types.CreateModelRequest,
                      ) -> dict[str, Any]:  # fmt: skip
        """``create_model``: a fresh adapter in a free slot."""
        self.served.check_name(request.base_model)
        hyper = self.lora_hyper(request.lora_config)
        optimizer = request.optimizer_config
        if getattr(optimizer, "type", "adamw") != "adamw":
            raise ServiceError(f"optimizer_config {optimizer!r} is not supported; only adamw.")
        model = self.new_model(tenant_id, session_id, request.model_seq_id)

        def run() -> dict[str, Any]:
            slot = self.slots.create(model.id, hyper)
            self.created(model, slot, hyper["r"], request.user_metadata)
            return {"model_id": model.id, "type": "create_model"}

        return self.submit_creation(model, "create_model", run)

    def submit_creation(self, model: Model, kind: str, run: Any) -> dict[str, Any]:
        """Queue a model's creation (its seq_id 0); a creation that fails leaves nothing:
        the model is forgotten and its id free again."""

        def guarded() -> dict[str, Any]:
            try:
                return run()
            except Exception as exc:
                self.engine.drop_model(model, f"model_id {model.id} could not be created: {exc}")
                raise

        future = self.engine.submit(
            model.tenant_id, model, 0, kind, lambda: Op(kind, None, run=guarded)
        )
        return queued(future, model.id)

    def created(self, model: Model, slot: int, rank: int, metadata: Any) -> None:
        """Worker: the model holds ``slot`` now; record its run."""
        try:
            self.db.record_model(model.tenant_id, model.id, model.session_id, self.served.name,
                                 rank, slot, metadata)  # fmt: skip
        except Exception:
            self.slots.release(model.id)
            raise
        model.rank, model.status = rank, ModelStatus.READY
        log.info("model %s created in slot %d (rank %d)", model.id, slot, rank)

    def submit_unload(self, model: Model) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            self.release(model)
            return {"model_id": model.id, "type": "unload_model"}

        future = self.engine.submit(model.tenant_id, None, None, "unload_model",
                                    lambda: Op("unload_model", None, run=run))  # fmt: skip
        return queued(future, model.id)

    def release(self, model: Model) -> None:
        """Free the model's slot (worker thread)."""
        slot = self.slots.release(model.id)
        if model.status != ModelStatus.UNLOADED:
            log.info("model %s unloaded (slot %s freed)", model.id, slot)
        model.status = ModelStatus.UNLOADED
        self.db.unload_model(model.tenant_id, model.id)

    def ready(self, model: Model, partly_written: bool = False) -> int:
        """Worker: the slot of a model that can train now (with ``partly_written``, also
        one a failed load left partly written: a load may repair it)."""
        if model.status != ModelStatus.READY:
            raise ServiceError(
                f"model_id {model.id} is {model.status}: {model.error or 'not ready'}"
            )
        slot = self.slots.usable(model.id, partly_written)
        self.db.touch_run(model.tenant_id, model.id)
        return slot

    # ------------------------------------------------------------------ training
    def submit_forward_backward(self, model: Model, request: ForwardBackwardRequest,
                                key: str) -> dict[str, Any]:  # fmt: skip
        kind = "forward" if request.forward_only else "forward_backward"
        future = self.engine.submit(model.tenant_id, model, request.seq_id, kind,
                                    lambda: self.prepare_forward_backward(model, request), key)  # fmt: skip
        return queued(future, model.id)

    def prepare_forward_backward(self, model: Model, request: ForwardBackwardRequest) -> Op:
        loss = get_loss(request.loss_fn, request.loss_fn_config)
        data = request.data()
        if not data:
            raise ServiceError("data is empty: a forward_backward needs at least one datum.")
        if len(data) > self.max_datums:
            raise ServiceError(
                f"data holds {len(data)} datums, more than serve.max_datums={self.max_datums} per "
                "request."
            )
        for i, datum in enumerate(data):
            n = datum.tokens.shape[0]
            if n == 0:
                raise ServiceError(f"data[{i}].model_input has no tokens.")
            if n > self.served.max_tokens:
                raise ServiceError(
                    f"data[{i}].model_input has {n} tokens, more than the model's context of "
                    f"{self.served.max_tokens} (data.max_seq_len)."
                )
            self.served.check_tokens(datum.tokens, f"data[{i}].model_input")
            check_inputs(loss, i, datum.tokens, datum.inputs, self.served.vocab)
        kind = "forward" if request.forward_only else "forward_backward"
        return Op(kind, None, batch=Batch(model, loss, request.forward_only, data))

    def forward_backward(self, ops: list[Op]) -> list[Any]:
        """Run the batches of ``ops`` (one per model, same loss) as one slot batch; only the
        slots of the forward_backward parts train."""
        parts: list[Batch] = [op.batch for op in ops]
        results: list[Any] = [None] * len(parts)
        live = []
        for k, part in enumerate(parts):  # a part that cannot run fails alone, not the batch
            try:
                live.append((k, part, self.ready(part.model)))
            except ServiceError as exc:
                results[k] = exc
        if not live:
            return results
        rows = [(slot, d) for _, part, slot in live for d in part.data]
        began = time.perf_counter()
        batch = build_batch(rows, parts[0].loss)
        training = {slot for _, part, slot in live if not part.forward_only}
        mixed = bool(training) and len(training) < len(live)
        out = self.trainer.forward_tokens(batch, parts[0].loss, backward=bool(training),
                                          train_slots=training if mixed else None)  # fmt: skip
        start = 0
        for k, part, slot in live:
            outputs, loss_sum = [], 0.0
            for j, datum in enumerate(part.data, start):
                outputs.append({"logprobs": out.logprobs[j, : datum.tokens.shape[0]].numpy()})
                loss_sum += float(out.row_losses[j])
            start += len(part.data)
            results[k] = encode_forward_backward_output(outputs, {"loss:sum": loss_sum})
            self.metrics.write(part.model.id, part.model.tenant_id, slot,
                               "forward" if part.forward_only else "forward_backward",
                               loss_sum=loss_sum, datums=len(part.data), rows_in_batch=len(rows),
                               seconds=round(time.perf_counter() - began, 6))  # fmt: skip
        return results

    def submit_optim_step(self, model: Model, seq_id: int, params: Any, key: str) -> dict[str, Any]:
        future = self.engine.submit(model.tenant_id, model, seq_id, "optim_step",
                                    lambda: self.prepare_optim_step(model, params), key)  # fmt: skip
        return queued(future, model.id)

    def prepare_optim_step(self, model: Model, params: Any) -> Op:
        values = adam_values(params)

        def run() -> dict[str, Any]:
            slot = self.ready(model)
            began = time.perf_counter()
            result = self.trainer.optim_step(
                slot, values["grad_clip_norm"], lr=values["learning_rate"],
                betas=(values["beta1"], values["beta2"]), eps=values["eps"],
                weight_decay=values["weight_decay"],
            )  # fmt: skip
            self.metrics.write(model.id, model.tenant_id, slot, "optim_step", **result,
                               seconds=round(time.perf_counter() - began, 6))  # fmt: skip
            return {"metrics": {"grad_norm:mean": result["grad_norm"],
                                "learning_rate:mean": result["lr"], "step:max": result["step"]}}  # fmt: skip

        return Op("optim_step", None, run=run)


def adam_values(params: Any) -> dict[str, float]:
    """The checked values of an ``AdamParams`` (refused naming the field)."""
    if not isinstance(params, types.AdamParams):
        raise ServiceError(
            f"optim_params: only adam_params (AdamParams) are supported, got {type(params).__name__}."
        )
    values = {}
    for key, (_, low, high) in ADAM.items():
        value = float(getattr(params, key))
        if not np.isfinite(value):
            raise ServiceError(f"adam_params.{key} must be a finite number, got {value!r}.")
        if value < low:
            raise ServiceError(f"adam_params.{key} must be >= {low:g}, got {value}.")
        if high is not None and value >= high:
            raise ServiceError(f"adam_params.{key} must be in [{low:g}, {high:g}), got {value}.")
        values[key] = value
    return values


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
