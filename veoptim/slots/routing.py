"""Slot adapters in the model, and the routing of batch rows to them.

Every targeted Linear holds one adapter per slot (``slot_<i>``), each with its own
parameters allocated at the slots' maximum rank (``lora.r``). Before a forward, the
:class:`SlotRouter` is told each row's slot and works out, once per batch, where every
row goes in a ``[slots, rows per slot, ...]`` layout (each slot's rows padded with zero
rows to the largest slot's count). Every LoRA layer then gathers its input into that
layout and runs all slots' adapters as one batched product pair (``torch.bmm`` over the
slots' stacked ``A`` and ``B``: grouped by slot, never row by row, and one kernel call
instead of one per slot), scales each slot by its own ``alpha / r`` and gathers the
deltas back into the original row order. A slot of a lower rank than the maximum uses
the leading ``r`` rows of ``A`` and columns of ``B``; the rest are exactly zero, so the
full-width product adds exact zeros and their gradients stay zero.

A slot that has rows on another rank but none here still runs (on zero rows), so its
parameters get (zero) gradients on every rank and FSDP reduces the same set everywhere.

A generation runs many forwards of one routing with weights that do not change between
them: :meth:`SlotRouter.hold_weights` stacks each layer's slot weights once and reuses the
stack until :meth:`SlotRouter.clear` (the same values: a copy made once instead of once per
forward). Rows already in slot-major order with no padding (every row of one slot, the
usual case of a single client or a group of samples) skip the two gathers: the same values
reach the same products.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from veoptim.config.schema import LoRAConfig
from veoptim.errors import ConfigError
from veoptim.lora.inject import adapter_spec, target_names
from veoptim.lora.layer import AdapterSpec, LoRALinear
from veoptim.optim.dtensor_util import local

SLOT_PREFIX = "slot_"


def slot_adapter_name(slot: int) -> str:
    return f"{SLOT_PREFIX}{slot}"


class SlotRouter:
    """Which rows of the current batch belong to which slot (set per forward)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        #: Per padded position (slot-major): the batch row it holds, or ``rows`` (a zero row).
        self._gather: torch.Tensor | None = None
        #: Per batch row: its padded position.
        self._scatter: torch.Tensor | None = None
        self._per_slot = 0
        #: The rows are in slot-major order without padding: the gathers are identities.
        self._in_order = False
        #: With hold_weights: each layer's stacked (A, B, scales), made on its first forward.
        self._held: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def route(self, slot_ids: torch.Tensor, slots: Sequence[int]) -> None:
        """``slot_ids[i]`` is row ``i``'s slot; ``slots`` every slot that runs (sorted, a
        superset of the slots in ``slot_ids``: those present on any rank)."""
        slot_ids = slot_ids.cpu()
        position = {slot: k for k, slot in enumerate(slots)}
        rows = int(slot_ids.numel())
        counts = [0] * len(slots)
        for slot in slot_ids.tolist():
            counts[position[slot]] += 1
        per_slot = max(max(counts, default=0), 1)
        gather = torch.full((len(slots) * per_slot,), rows, dtype=torch.long)
        scatter = torch.empty(rows, dtype=torch.long)
        filled = [0] * len(slots)
        for row, slot in enumerate(slot_ids.tolist()):
            k = position[slot]
            target = k * per_slot + filled[k]
            filled[k] += 1
            gather[target], scatter[row] = row, target
        names = [slot_adapter_name(s) for s in slots]
        if self._held is not None and names != self._names:
            self._held = {}  # other slots: other stacks
        self._names = names
        self._gather, self._scatter, self._per_slot = gather, scatter, per_slot
        self._in_order = len(slots) * per_slot == rows and bool(
            torch.equal(gather, torch.arange(rows))
        )

    def hold_weights(self) -> None:
        """Until :meth:`clear`, stack each layer's slot weights on its first forward and
        reuse them, also across routings of the same slots: for the forwards of one
        generation, between which no weight changes (no gradients; the caller holds the
        trainer's lock). Holds one copy of the routed slots' adapter weights meanwhile."""
        self._held = {}

    def clear(self) -> None:
        self._gather = self._scatter = None
        self._held = None

    def _stacked(self, layer: LoRALinear, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The routed slots' A [slots, r, in], B [slots, out, r] and scales [slots]."""
        held = None if self._held is None else self._held.get(layer)
        if held is not None:
            return held
        names = self._names
        a = torch.stack([layer.lora_A[n].weight for n in names])
        b = torch.stack([layer.lora_B[n].weight for n in names])
        scales = torch.tensor(
            [layer.specs[n].scaling for n in names], dtype=torch.float32, device=device
        )
        if self._held is not None:
            self._held[layer] = (a, b, scales)
        return a, b, scales

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The gather and scatter indices on ``device`` (moved there once per routing)."""
        assert self._gather is not None and self._scatter is not None
        if self._gather.device != device:
            self._gather, self._scatter = self._gather.to(device), self._scatter.to(device)
        return self._gather, self._scatter

    def add_deltas(self, layer: LoRALinear, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        if self._gather is None or self._scatter is None:
            raise RuntimeError(
                "a multi-LoRA model was called without slot routing; run it through SlotTrainer "
                "(or SlotRouter.route) so each row uses its slot's adapter."
            )
        names = self._names
        a, b, scales = self._stacked(layer, x.device)  # [slots, r, in], [slots, out, r]
        gather, scatter = self._on(x.device)
        row_shape = x.shape[1:-1]
        padded = (
            x
            if self._in_order
            else torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).index_select(0, gather)
        )  # [slots * per_slot, ..., in], slot-major; padding rows are zero
        padded = padded.to(a.dtype).reshape(len(names), -1, x.shape[-1])
        dropout = layer.lora_dropout[names[0]]
        out = torch.bmm(torch.bmm(dropout(padded), a.transpose(1, 2)), b.transpose(1, 2))
        out = (out * scales.view(-1, 1, 1)).to(result.dtype)
        out = out.reshape(-1, *row_shape, out.shape[-1])
        return result + (out if self._in_order else out.index_select(0, scatter))


def apply_slot_lora(model: nn.Module, cfg: LoRAConfig, num_slots: int) -> SlotRouter:
    """Freeze ``model`` and give every target Linear ``num_slots`` adapters of rank
    ``cfg.r`` (each slot's maximum), all routed by one :class:`SlotRouter`."""
    if num_slots < 1:
        raise ConfigError(f"lora.num_slots must be >= 1 for multi-LoRA, got {num_slots}.")
    if cfg.target_experts:
        raise ConfigError(
            "multi-LoRA slots adapt Linear layers only; lora.target_experts must be empty with "
            f"lora.num_slots, got {list(cfg.target_experts)}."
        )
    if cfg.r <= 0 or cfg.alpha <= 0 or not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(
            f"lora.r and lora.alpha must be > 0 and lora.dropout in [0, 1), got r={cfg.r}, "
            f"alpha={cfg.alpha}, dropout={cfg.dropout}."
        )
    names = target_names(model, cfg)
    model.requires_grad_(False)
    router = SlotRouter()
    spec = adapter_spec(cfg)
    with torch.random.fork_rng(devices=[]):  # placeholders: every slot is re-initialised on create
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoRALinear(getattr(parent, child))
            for slot in range(num_slots):
                layer.add_adapter(slot_adapter_name(slot), spec)
            layer.active = ()
            layer.router = router
            setattr(parent, child, layer)
    return router


def slot_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


class SlotParams:
    """One slot's parameters under slot-independent names (``...q_proj.lora_A.weight``), so
    a slot's checkpoint loads into any slot. Quacks like a module for the optimizer builder
    and checkpoint helpers (``named_parameters`` / ``parameters``)."""

    def __init__(self, model: nn.Module, slot: int) -> None:
        adapter = slot_adapter_name(slot)
        self.slot = slot
        self.layers = slot_layers(model)
        self.named: list[tuple[str, nn.Parameter]] = [
            (f"{fqn}.{kind}.weight", getattr(layer, kind)[adapter].weight)
            for fqn, layer in self.layers.items()
            for kind in ("lora_A", "lora_B")
        ]
        self.adapter = adapter

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self.named)

    def parameters(self) -> Iterator[nn.Parameter]:
        return (p for _, p in self.named)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named)

    def set_spec(self, spec: AdapterSpec) -> None:
        for layer in self.layers.values():
            layer.specs[self.adapter] = spec

    @property
    def spec(self) -> AdapterSpec:
        return next(iter(self.layers.values())).specs[self.adapter]

    @torch.no_grad()
    def initialise(self, seed: int, spec: AdapterSpec) -> None:
        """Fresh adapters: A Kaiming-uniform (PEFT's ``a = sqrt(5)``) in its leading ``r``
        rows, zero elsewhere; B zero. Drawn from ``seed`` as full tensors, so every rank
        and every layout gets the same values; each rank keeps its shard."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named:
            full = torch.zeros(param.shape, dtype=torch.float32)
            if ".lora_A." in name:
                bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5))
                full[: spec.r].uniform_(-bound, bound, generator=generator)
            local(param).copy_(shard_of(param, full))
        self.set_spec(spec)

    @torch.no_grad()
    def zero_(self) -> None:
        for _, param in self.named:
            local(param).zero_()


def shard_of(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (a whole tensor shaped like ``param``)."""
    if not isinstance(param, DTensor):
        return full
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return full[index]
