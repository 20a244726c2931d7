"""``SlotTrainer``: several LoRA adapters ("slots") trained at once on one frozen base.

The API has the shape of hosted LoRA training services: ``forward_backward`` over a
batch whose rows name their slots, ``optim_step`` per slot, ``save_slot`` /
``load_slot`` (training state) and ``export_slot`` (a PEFT adapter: the weights to
sample from). Every slot has its own parameters, optimizer (FP32 masters for BF16 adapters
with the exact optimizers), scheduler and checkpoints. A call names one slot and
changes nothing of any other; a failing save or load raises :class:`SlotError` for that
slot only. Under ``torchrun`` every rank makes the same calls in the same order (each
with its own batch rows); a lock serialises calls from several threads.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from veoptim.checkpoint import collect_garbage, unpublish, validate_name
from veoptim.config.launch import check_launch
from veoptim.config.validate import validate_config
from veoptim.data import IGNORE_INDEX, load_tokenizer, special_token_ids
from veoptim.data.fields import ATTENTION_MASK, INPUT_IDS, LABELS, POSITION_IDS
from veoptim.distributed import DistContext, build_parallel_plan, init_distributed
from veoptim.distributed.agreement import on_rank0
from veoptim.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LiveStateInvalidError,
    SlotError,
    SlotStateInvalidError,
    VeoptimError,
)
from veoptim.lora.layer import AdapterSpec
from veoptim.lora.state import base_fingerprint
from veoptim.losses import sequence_logps
from veoptim.models import build_model
from veoptim.models.build import check_model_fits
from veoptim.slots.config import MultiLoRAConfig
from veoptim.slots.export import SLOT_EXPORTS, publish_slot_adapter
from veoptim.slots.optim import OPTIM_KEYS, SlotHyper, SlotOptimizer
from veoptim.slots.routing import SlotParams, SlotRouter, apply_slot_lora
from veoptim.slots.state import (
    ADAPTER,
    LR_SCHEDULER,
    OPTIMIZER,
    SlotAdapterState,
    SlotOptimizerState,
)
from veoptim.slots.store import SlotStore
from veoptim.state.stateful import JSONState, same_structure

log = logging.getLogger(__name__)
T = TypeVar("T")
SLOT_IDS = "slot_ids"
SLOTS_SUBDIR = "slots"
ADAPTER_KEYS = ("r", "alpha", "use_rslora", "seed")


@dataclass(frozen=True)
class SlotLoss:
    """A slot's share of one ``forward_backward``, summed over every rank."""

    loss_sum: float
    tokens: int
    rows: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens


@dataclass
class _Slot:
    params: SlotParams
    optimizer: SlotOptimizer
    seed: int
    invalid: bool = False


class SlotTrainer:
    """Build with :meth:`from_config`; see ``docs/multi_lora.md`` for the whole API."""

    def __init__(self, cfg: MultiLoRAConfig, ctx: DistContext, *, owns_ctx: bool = False) -> None:
        validate_config(cfg)
        cfg.check_slot_keys()
        if cfg.slots.keep_last < 0:
            raise ConfigError(f"slots.keep_last must be >= 0 (0 = all), got {cfg.slots.keep_last}.")
        check_launch(cfg.parallel, ctx.world_size)
        self.cfg, self.ctx, self._owns_ctx = cfg, ctx, owns_ctx
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = load_tokenizer(
            cfg.data.tokenizer_path, model_path=cfg.model.path, chat_template=cfg.data.chat_template
        )
        check_model_fits(cfg.model, len(self.tokenizer), cfg.data.max_seq_len,
                         self.tokenizer.name_or_path)  # fmt: skip
        on_meta = ctx.world_size > 1 and not ctx.is_main
        model = build_model(
            cfg.model, len(self.tokenizer), special_token_ids(self.tokenizer), on_meta=on_meta
        )
        self.router: SlotRouter = apply_slot_lora(model, cfg.lora, cfg.lora.num_slots)
        self.plan = build_parallel_plan(
            cfg.parallel, ctx, num_experts=getattr(model.config, "num_experts", 0) or 0
        )
        self.model = self.plan.apply(model)
        self.model.train()
        self.fingerprint = base_fingerprint(
            model.config, cfg.model.path, cfg.model.init_seed, cfg.model.quant
        )
        self.layout = self.plan.layout_metadata().to_json()
        self.run_dir = Path(cfg.run.dir)
        self.store = SlotStore(
            cfg.checkpoint.root_dir(self.run_dir) / SLOTS_SUBDIR,
            keep_last=cfg.slots.keep_last,
            fsync=cfg.checkpoint.fsync,
            write_threads=cfg.checkpoint.write_threads,
        )
        self.exports_root = self.run_dir / "exports"
        self._params = [SlotParams(self.model, s) for s in range(cfg.lora.num_slots)]
        self.slots: dict[int, _Slot] = {}
        self._specs: dict[int, AdapterSpec] = {}
        self._lock = threading.RLock()

    @classmethod
    def from_config(cls, cfg: MultiLoRAConfig, ctx: DistContext | None = None) -> SlotTrainer:
        """The trainer of ``cfg`` (a :class:`MultiLoRAConfig`); joins the process group of a
        ``torchrun`` launch unless ``ctx`` is given (:meth:`close` leaves it again)."""
        if ctx is not None:
            return cls(cfg, ctx)
        ctx = init_distributed(cfg.run.device, cfg.parallel.backend, os.environ)
        try:
            return cls(cfg, ctx, owns_ctx=True)
        except BaseException:
            ctx.close()
            raise

    def close(self) -> None:
        """Drop the model and the slots, and leave the process group this trainer joined
        (:meth:`from_config` without ``ctx``; a given ``ctx`` stays open).

        The model and its slots go first: they hold the process groups, which the context can
        only destroy (and their threads join) once nothing holds them. Unusable afterwards.
        """
        with self._lock:
            self.slots.clear()
            self._params.clear()
            self.model = self.router = self.plan = None  # type: ignore[assignment]
        if self._owns_ctx:
            self.ctx.close()

    @property
    def lock(self) -> threading.RLock:
        """Held by every pass over the model and every change of a slot (reentrant)."""
        return self._lock

    def present_slots(self, slot_ids: torch.Tensor) -> list[int]:
        """The slots with rows on any rank (sorted; collective), each checked to exist and
        be whole."""
        present = self._present(slot_ids)
        for slot in present:
            self._slot(slot)
        return present

    @property
    def num_slots(self) -> int:
        return len(self._params)

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` holds an adapter (created or loaded; maybe partly written)."""
        return slot in self.slots

    def partly_written(self, slot: int) -> bool:
        """Whether a failed load left ``slot`` partly written (it trains no more until it is
        reset, released or loaded again)."""
        state = self.slots.get(slot)
        return state is not None and state.invalid

    # ------------------------------------------------------------------ slot lifecycle
    def create_slot(self, slot: int, **hyperparameters: Any) -> None:
        """Initialise a free slot: ``r`` (<= lora.r), ``alpha``, ``use_rslora``, ``seed``
        and the optimizer's ``lr``, ``betas``, ``eps``, ``weight_decay`` (config defaults)."""
        with self._lock:
            self._check_index(slot)
            if slot in self.slots:
                raise SlotError(slot, "already exists; reset_slot or release_slot it first.")
            unknown = sorted(set(hyperparameters) - {*ADAPTER_KEYS, *OPTIM_KEYS})
            if unknown:
                raise SlotError(
                    slot,
                    f"unknown hyperparameters {unknown}; known: {[*ADAPTER_KEYS, *OPTIM_KEYS]}.",
                )
            lora = self.cfg.lora
            spec = AdapterSpec(
                r=int(hyperparameters.get("r", lora.r)),
                alpha=float(hyperparameters.get("alpha", lora.alpha)),
                dropout=lora.dropout,
                use_rslora=bool(hyperparameters.get("use_rslora", lora.use_rslora)),
            )
            if not (1 <= spec.r <= lora.r and spec.alpha > 0):
                raise SlotError(
                    slot, f"r must be in [1, {lora.r}] (lora.r) and alpha > 0, got r={spec.r}, "
                    f"alpha={spec.alpha}."
                )  # fmt: skip
            optim = {k: v for k, v in hyperparameters.items() if k in OPTIM_KEYS}
            try:
                hyper = SlotHyper.from_config(self.cfg.optim).updated(**optim)
            except VeoptimError as exc:
                raise SlotError(slot, str(exc)) from exc
            seed = int(hyperparameters.get("seed", self.cfg.slots.seed + slot))
            self._params[slot].initialise(seed, spec)
            self.slots[slot] = _Slot(self._params[slot], self._new_optimizer(slot, hyper), seed)
            self._specs[slot] = spec

    def reset_slot(self, slot: int) -> None:
        """Fresh adapter (the slot's seed and spec from create_slot), zero moments, step 0."""
        with self._lock:
            state = self._slot(slot, allow_invalid=True)
            self._params[slot].initialise(state.seed, self._specs[slot])
            hyper = state.optimizer.hyper
            self.slots[slot] = _Slot(state.params, self._new_optimizer(slot, hyper), state.seed)

    def release_slot(self, slot: int) -> None:
        """Free the slot: its adapter is zeroed and its optimizer state dropped."""
        with self._lock:
            self._slot(slot, allow_invalid=True)
            for p in self._params[slot].parameters():
                p.grad = None
            self._params[slot].zero_()
            del self.slots[slot], self._specs[slot]

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: dict[str, torch.Tensor]) -> dict[int, SlotLoss]:
        """Forward and backward over a batch whose ``slot_ids`` name each row's slot;
        gradients (token-loss sums) accumulate into each slot present. Returns each present
        slot's loss sum, tokens and rows over all ranks."""
        with self._lock:
            slot_ids = self.batch_slot_ids(batch)
            labels = batch[LABELS]
            tokens = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1).double()
            n = self.num_slots
            counts = torch.zeros(2, n, dtype=torch.float64)
            counts[0].index_add_(0, slot_ids, torch.ones_like(tokens))
            counts[1].index_add_(0, slot_ids, tokens)
            rows, slot_tokens = self.plan.all_reduce_sum(counts.to(self.ctx.device)).cpu().tolist()
            present = [s for s in range(n) if rows[s] > 0]
            for s in present:
                self._slot(s)
                if slot_tokens[s] == 0:
                    raise SlotError(
                        s, "its rows in this batch have no labelled tokens to train on."
                    )
            device = self.ctx.device
            inputs = {
                k: batch[k].to(device)
                for k in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)
                if k in batch
            }
            ids = slot_ids.to(device)
            self.router.route(ids, present)
            try:
                logits = self.model(**inputs, use_cache=False).logits
                row_sums = -sequence_logps(logits, labels.to(device))[0]
                loss_sums = torch.zeros(n, dtype=row_sums.dtype, device=device).index_add(
                    0, ids, row_sums
                )
                loss_sums.sum().backward()
            finally:
                self.router.clear()
            global_sums = self.plan.all_reduce_sum(loss_sums.detach()).cpu().tolist()
            for s in present:
                self.slots[s].optimizer.pending_tokens += slot_tokens[s]
            return {s: SlotLoss(global_sums[s], int(slot_tokens[s]), int(rows[s])) for s in present}

    def optim_step(self, slot: int, **adam_params: Any) -> dict[str, float]:
        """One optimizer step of ``slot`` alone over its accumulated gradients; ``lr``,
        ``betas``, ``eps``, ``weight_decay`` given here apply from this step on."""
        with self._lock:
            state = self._slot(slot)
            try:
                hyper = state.optimizer.hyper.updated(**adam_params)
            except VeoptimError as exc:
                raise SlotError(slot, str(exc)) from exc
            if state.optimizer.pending_tokens <= 0:
                raise SlotError(
                    slot, "has no accumulated gradients; call forward_backward with rows of "
                    "this slot before optim_step."
                )  # fmt: skip
            if hyper != state.optimizer.hyper:
                state.optimizer.set_hyper(hyper)
            return state.optimizer.step(self.cfg.train.grad_clip)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[int, dict[str, float]]:
        """``forward_backward`` then ``optim_step`` of every slot in the batch."""
        with self._lock:
            losses = self.forward_backward(batch)
            return {
                s: {"loss": loss.loss, "tokens": loss.tokens, **self.optim_step(s)}
                for s, loss in losses.items()
            }

    # ------------------------------------------------------------------ checkpoints, exports
    def save_slot(self, slot: int, name: str, with_optimizer: bool = True) -> Path:
        """Publish the next save of checkpoint ``name`` from ``slot``: its adapter and (with
        ``with_optimizer``) its optimizer state and schedule; without, a weights-only
        checkpoint. Returns the immutable version directory (loadable as a path)."""
        with self._lock:
            state = self._slot(slot)
            components: dict[str, Any] = {ADAPTER: SlotAdapterState(state.params, self.fingerprint)}
            if with_optimizer:
                components[OPTIMIZER] = SlotOptimizerState(
                    state.optimizer, self.layout, self.ctx.world_size
                )
                components[LR_SCHEDULER] = JSONState(state.optimizer.scheduler, same_structure)
            published = self._as_slot_error(
                slot,
                f"saving it as {name!r}",
                lambda: self.store.save(
                    name, components, layout=self.layout, weights_only=not with_optimizer
                ),
            )
            log.info("saved slot %d as %s", slot, published.path)
            return published.path

    def load_slot(
        self, slot: int, ckpt_path: str | os.PathLike[str], load_optimizer: bool = True
    ) -> Path:
        """Load a slot checkpoint (``<name>``, ``<name>/save_<n>`` or a path in the slots
        root) into ``slot``, free or not. Everything is validated before the first write;
        a rejected checkpoint leaves this slot and every other unchanged."""
        with self._lock:
            self._check_index(slot)
            path, weights_only = self._as_slot_error(
                slot, "", lambda: self.store.resolve(ckpt_path)
            )
            if load_optimizer and weights_only:
                raise SlotError(
                    slot, f"{path} is a sampler checkpoint (saved with with_optimizer=False) and "
                    "holds no optimizer state; load it with load_optimizer=False."
                )  # fmt: skip
            current = self.slots.get(slot)
            hyper = current.optimizer.hyper if current else SlotHyper.from_config(self.cfg.optim)
            optimizer = self._new_optimizer(slot, hyper)
            components: dict[str, Any] = {
                ADAPTER: SlotAdapterState(self._params[slot], self.fingerprint)
            }
            if load_optimizer:
                components[OPTIMIZER] = SlotOptimizerState(
                    optimizer, self.layout, self.ctx.world_size
                )
                components[LR_SCHEDULER] = JSONState(optimizer.scheduler, same_structure)
            try:
                self.store.load(components, path, exact=load_optimizer)
            except LiveStateInvalidError as exc:
                seed = current.seed if current else self.cfg.slots.seed + slot
                self.slots[slot] = _Slot(self._params[slot], optimizer, seed, invalid=True)
                raise SlotStateInvalidError(
                    slot, f"loading {os.fspath(ckpt_path)!r} failed after its adapter was "
                    f"partly written: {exc} "
                    "Reset, release or load this slot again before training it."
                ) from exc  # fmt: skip
            except (CheckpointError, OSError) as exc:
                raise SlotError(slot, f"loading {os.fspath(ckpt_path)!r} failed: {exc}") from exc
            if load_optimizer:
                optimizer.hyper = optimizer.hyper_from_groups()
            for p in self._params[slot].parameters():
                p.grad = None
            seed = current.seed if current else self.cfg.slots.seed + slot
            self.slots[slot] = _Slot(self._params[slot], optimizer, seed)
            self._specs[slot] = self._params[slot].spec
            log.info("loaded %s into slot %d (optimizer state: %s)", path, slot, load_optimizer)
            return path

    def export_slot(self, slot: int, name: str) -> Path:
        """Publish ``slot``'s adapter as PEFT adapter directory ``name`` under
        ``<run.dir>/exports/slots`` (the base built from config is exported once beside it,
        as ``exports/hf_base``). Returns the published name's path."""
        with self._lock:
            state = self._slot(slot)
            return self._as_slot_error(
                slot,
                f"exporting it as {name!r}",
                lambda: publish_slot_adapter(
                    self.model,
                    state.params,
                    name,
                    self.cfg,
                    self.tokenizer,
                    self.exports_root,
                    is_main=self.ctx.is_main,
                ),  # fmt: skip
            )

    def delete_checkpoint(self, name: str) -> None:
        """Delete slot checkpoint ``name`` (every save of it) and its PEFT export, if any,
        manifests first (collective: rank 0 removes)."""
        with self._lock:
            self.store.delete(name)
            exports = self.exports_root / SLOT_EXPORTS
            on_rank0(lambda: unpublish(exports, validate_name(name)),
                     f"deleting the export {name!r}", self.store.group)  # fmt: skip

    def prune_checkpoints(self, keep: Collection[str]) -> list[str]:
        """Delete every slot checkpoint (and export) whose name is not in ``keep``: what a
        caller that records its checkpoints elsewhere never recorded (a save killed before
        it was published, or before the caller noted it). The names deleted."""
        with self._lock:
            gone = [name for name in self.store.names() if name not in keep]
            for name in gone:
                self.delete_checkpoint(name)
            exports = self.exports_root / SLOT_EXPORTS

            def clean_exports() -> None:
                if exports.is_dir():
                    collect_garbage(exports)

            on_rank0(clean_exports, f"cleaning the exports in {exports}", self.store.group)
            return gone

    def export_dir(self, name: str) -> Path:
        """Where :meth:`export_slot` publishes PEFT adapter directory ``name``."""
        return self.exports_root / SLOT_EXPORTS / name

    # ------------------------------------------------------------------ inspection
    def check_slot(self, slot: int) -> None:
        """Refuse ``slot`` unless it exists and is not partly written (``SlotError``)."""
        self._slot(slot)

    def slot_parameters(self, slot: int) -> list[torch.nn.Parameter]:
        """The trainable parameters of ``slot``'s adapter (its share on this rank)."""
        return list(self._slot(slot, allow_invalid=True).params.parameters())

    def batch_slot_ids(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The batch's ``slot_ids`` (one slot index per row, on the CPU), refused with a
        ``DataError`` unless it has ``input_ids``, ``labels`` and a slot index per row."""
        if SLOT_IDS not in batch or LABELS not in batch or INPUT_IDS not in batch:
            raise DataError(
                f"a slot batch needs {INPUT_IDS!r}, {LABELS!r} and {SLOT_IDS!r}; got {sorted(batch)}."
            )
        ids = torch.as_tensor(batch[SLOT_IDS]).long().cpu()
        rows = batch[INPUT_IDS].shape[0]
        if ids.shape != (rows,) or bool(((ids < 0) | (ids >= self.num_slots)).any()):
            raise DataError(
                f"batch {SLOT_IDS!r} must hold one slot index in [0, {self.num_slots}) per row "
                f"({rows} rows); got {ids.tolist()}."
            )
        return ids

    def _present(self, slot_ids: torch.Tensor) -> list[int]:
        """The slots with rows on any rank (sorted; collective)."""
        rows = torch.zeros(self.num_slots, dtype=torch.float64)
        rows.index_add_(0, slot_ids, torch.ones(len(slot_ids), dtype=torch.float64))
        rows = self.plan.all_reduce_sum(rows.to(self.ctx.device)).cpu()
        return [s for s in range(self.num_slots) if rows[s] > 0]

    def apply_unscaled(self, slot: int) -> None:
        """The gradients ``slot`` accumulated are a loss *sum* (a caller's loss, not
        :meth:`forward_backward`'s token mean): its next :meth:`optim_step` applies them
        unscaled."""
        self._slot(slot).optimizer.pending_tokens = 1.0

    def slot_state(self, slot: int) -> dict[str, Any]:
        """The slot's adapter weights, FP32 masters, moments and step counters (whole
        tensors on the CPU, by slot-independent name), param groups, schedule and spec.
        Gathers sharded tensors: collective."""
        with self._lock:
            return self._slot(slot, allow_invalid=True).optimizer.snapshot()

    # ------------------------------------------------------------------ helpers
    def _new_optimizer(self, slot: int, hyper: SlotHyper) -> SlotOptimizer:
        cfg = self.cfg
        return SlotOptimizer(
            self._params[slot], cfg.optim, cfg.scheduler, cfg.schedule_steps, hyper
        )

    def _check_index(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise SlotError(slot, f"is not a slot index in [0, {self.num_slots}) (lora.num_slots).")

    def _slot(self, slot: int, *, allow_invalid: bool = False) -> _Slot:
        self._check_index(slot)
        state = self.slots.get(slot)
        if state is None:
            raise SlotError(slot, "does not exist; create_slot or load_slot it first.")
        if state.invalid and not allow_invalid:
            raise SlotStateInvalidError(
                slot, "a failed load left it partly written; reset, release or load it again."
            )
        return state

    def _as_slot_error(self, slot: int, what: str, action: Callable[[], T]) -> T:
        try:
            return action()
        except (CheckpointError, OSError) as exc:
            raise SlotError(slot, f"{what} failed: {exc}" if what else str(exc)) from exc
