"""A slot's checkpoint components: its adapter weights, and its optimizer state.

Tensors are keyed by slot-independent names, so a checkpoint of slot 0 loads into any
slot. Both components stage into fresh buffers and validate everything (base, rank,
keys, shapes, dtypes, optimizer type, topology) before the checkpointer's apply phase;
``install`` then writes only the target slot's own tensors: the adapter's parameters
and the target slot's (new) optimizer. No other slot's weights or FP32 masters are
read or written, so nothing can be re-derived from BF16 values behind their back.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from veoptim.checkpoint import ComponentState, SavedComponent, Staged
from veoptim.errors import CheckpointError
from veoptim.lora.layer import AdapterSpec
from veoptim.lora.state import BASE, check_base
from veoptim.optim.dtensor_util import local
from veoptim.slots.optim import SlotOptimizer
from veoptim.slots.routing import SlotParams
from veoptim.state.model import module_inventory
from veoptim.state.optimizer import (
    PARAM_GROUPS,
    STATELESS,
    check_loadable,
    optimizer_buffers,
    optimizer_inventory,
    saved_param_groups,
    saved_stateless,
    to_json_param_groups,
)

ADAPTER, OPTIMIZER, LR_SCHEDULER = "adapter", "optimizer", "lr_scheduler"
SPEC, MAX_RANK, OPTIMIZER_TYPE = "spec", "max_rank", "optimizer_type"


class SlotAdapterState:
    """A slot's adapter parameters and spec (rank, alpha), and the base they belong to."""

    def __init__(self, params: SlotParams, fingerprint: dict[str, Any]) -> None:
        self.params, self.fingerprint = params, fingerprint

    def state(self) -> ComponentState:
        max_rank = self.params.named[0][1].shape[0]
        return ComponentState(
            tensors=self.params.tensors(),
            json={BASE: self.fingerprint, SPEC: asdict(self.params.spec), MAX_RANK: max_rank},
        )

    def stage(self, saved: SavedComponent) -> Staged:
        check_base(saved, self.fingerprint)
        spec = self._saved_spec(saved)
        live = self.params.tensors()
        buffers = {name: torch.empty_like(t) for name, t in live.items()}

        @torch.no_grad()
        def install() -> None:
            for name, param in live.items():
                local(param).copy_(local(buffers[name]))
            self.params.set_spec(spec)

        return Staged(expected=module_inventory(live), buffers=buffers, install=install)

    def _saved_spec(self, saved: SavedComponent) -> AdapterSpec:
        where = f"the adapter of slot checkpoint {saved.path}"
        max_rank = self.params.named[0][1].shape[0]
        found = saved.json if isinstance(saved.json, dict) else {}
        if found.get(MAX_RANK) != max_rank:
            raise CheckpointError(
                f"{where} was saved with slots of maximum rank {found.get(MAX_RANK)!r}; this "
                f"trainer's slots have maximum rank {max_rank} (lora.r)."
            )
        try:
            spec = AdapterSpec(**found[SPEC])
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"{where} has a malformed spec {found.get(SPEC)!r}.") from exc
        if not (isinstance(spec.r, int) and 1 <= spec.r <= max_rank and spec.alpha > 0):
            raise CheckpointError(
                f"{where} has rank {spec.r!r} and alpha {spec.alpha!r}; expected a rank in "
                f"[1, {max_rank}] and alpha > 0."
            )
        if spec.dropout != self.params.spec.dropout:
            spec = AdapterSpec(spec.r, spec.alpha, self.params.spec.dropout, spec.use_rslora)
        return spec


class SlotOptimizerState:
    """A slot optimizer's per-parameter state (DCP, sharded like the parameters) and its
    param groups (JSON). Loads only under the exact topology it was saved under."""

    def __init__(self, slot_optimizer: SlotOptimizer, layout: dict[str, Any], world: int) -> None:
        self.slot_optimizer, self.layout, self.world = slot_optimizer, layout, world

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        return self.slot_optimizer.optimizer

    def state(self) -> ComponentState:
        params, optimizer = self.slot_optimizer.params, self._optimizer
        state: dict[str, dict[str, Any]] = {}
        stateless: list[str] = []
        for name, param in params.named:
            entry = optimizer.state.get(param)
            if entry:
                state[name] = dict(entry)
            else:
                stateless.append(name)
        check_loadable(state, optimizer_inventory(params, optimizer, stateless))  # type: ignore[arg-type]
        groups = to_json_param_groups(optimizer.state_dict()[PARAM_GROUPS])
        return ComponentState(
            tensors=state,
            json={
                PARAM_GROUPS: groups,
                STATELESS: stateless,
                OPTIMIZER_TYPE: type(optimizer).__name__,
            },
        )

    def stage(self, saved: SavedComponent) -> Staged:
        params, optimizer = self.slot_optimizer.params, self._optimizer
        where = f"the optimizer state of slot checkpoint {saved.path}"
        saved_world, saved_layout = saved.world_size, saved.layout
        if saved_world != self.world or saved_layout != self.layout:
            raise CheckpointError(
                f"{where} was saved on {saved_world} ranks, layout {_describe(saved_layout)}; "
                f"this trainer runs {self.world} ranks, layout {_describe(self.layout)}. "
                "Optimizer state needs the same topology: load the weights only "
                "(load_optimizer=False)."
            )
        found_type = saved.json.get(OPTIMIZER_TYPE) if isinstance(saved.json, dict) else None
        if found_type != type(optimizer).__name__:
            raise CheckpointError(
                f"{where} is {found_type!r} state; this trainer's slots use "
                f"{type(optimizer).__name__} (optim.name)."
            )
        groups = saved_param_groups(saved, len(optimizer.param_groups))
        stateless = saved_stateless(saved, params, optimizer)  # type: ignore[arg-type]
        buffers = optimizer_buffers(params, optimizer, stateless)  # type: ignore[arg-type]

        def install() -> None:
            index, state = 0, {}
            for group in optimizer.param_groups:
                for param in group["params"]:
                    name = optimizer.param_names[id(param)]  # type: ignore[attr-defined]
                    if name in buffers:
                        state[index] = buffers[name]
                    index += 1
            live_groups = optimizer.state_dict()[PARAM_GROUPS]
            optimizer.load_state_dict(
                {
                    "state": state,
                    PARAM_GROUPS: [
                        {**saved_group, "params": live["params"]}
                        for saved_group, live in zip(groups, live_groups, strict=True)
                    ],
                }
            )

        return Staged(
            expected=optimizer_inventory(params, optimizer, stateless),  # type: ignore[arg-type]
            buffers=buffers,
            install=install,
        )


def _describe(layout: Any) -> str:
    """``dp_replicate=1 x efsdp=2 x ep=1`` (the mesh), or the raw value if malformed."""
    try:
        dims = zip(layout["mesh_dim_names"], layout["mesh_dim_sizes"], strict=True)
        return " x ".join(f"{name}={size}" for name, size in dims)
    except (KeyError, TypeError, ValueError):
        return repr(layout)
