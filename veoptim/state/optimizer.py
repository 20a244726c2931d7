"""An optimizer's state as a component: per-parameter tensors in DCP, param groups in JSON.

The expected inventory comes from the optimizer's full parameter inventory (every
parameter it holds, the state keys, local shapes and dtypes it keeps for each), not
from the file. Staging buffers are allocated where the optimizer keeps the state
(host memory for offloaded groups) and sharded like their parameter, so DCP reads
this rank's shard directly. Optimizer state is only accepted under the parallel
layout it was saved with (``LayoutMetadata.optimizer_compatible``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from veoptim.checkpoint import (
    ComponentState,
    Inventory,
    SavedComponent,
    Staged,
    TensorSpec,
)
from veoptim.distributed.layout import LayoutMetadata
from veoptim.errors import CheckpointError
from veoptim.optim import dcp_state_init
from veoptim.optim.base import ValidatedOptimizerMixin
from veoptim.optim.checks import expected_optimizer_state
from veoptim.optim.dtensor_util import local, wrap_like

PARAM_GROUPS = "param_groups"
#: Parameters the optimizer holds but keeps no state for (frozen before their first step).
STATELESS = "stateless"
Buffers = dict[str, dict[str, torch.Tensor]]


def trainable_named_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor]]:
    """(fqn, param) of every parameter the optimizer holds, in model order."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [(name, p) for name, p in model.named_parameters() if id(p) in held]


def optimizer_inventory(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, stateless: Collection[str] = ()
) -> Inventory:
    """Specs of ``<fqn>.<state key>`` for the optimizer's full parameter inventory
    (less the ``stateless`` parameters).

    The optimizer reports local shapes; a state tensor with the parameter's local
    shape is sharded like the parameter, so its global shape is the parameter's.
    """
    inventory: Inventory = {}
    for fqn, param in trainable_named_params(model, optimizer):
        if fqn in stateless:
            continue
        local_shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
        for key, (shape, dtype) in expected_optimizer_state(optimizer, param).items():
            global_shape = param.shape if tuple(shape) == tuple(local_shape) else shape
            inventory[f"{fqn}.{key}"] = TensorSpec(tuple(global_shape), dtype)
    return inventory


def _state_device(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.device:
    """Where the optimizer keeps ``param``'s state (host memory for offloaded groups)."""
    placement = getattr(optimizer, "state_device", None)
    if placement is None:
        return local(param).device
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    return placement(param, group)


def optimizer_buffers(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, stateless: Collection[str] = ()
) -> Buffers:
    """``{fqn: {state key: empty tensor}}`` with the expected dtype, local shape and sharding
    (fresh buffers, never the live state)."""
    staging: Buffers = {}
    for fqn, param in trainable_named_params(model, optimizer):
        if fqn in stateless:
            continue
        device = _state_device(optimizer, param)
        entry = {}
        for key, (shape, dtype) in expected_optimizer_state(optimizer, param).items():
            buffer = torch.empty(shape, dtype=dtype, device=device)
            if tuple(shape) == tuple(local(param).shape):
                buffer = wrap_like(param, buffer)
            entry[key] = buffer
        staging[fqn] = entry
    return staging


def to_json_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param-group hyperparameters as JSON values (tuples -> lists, 0-d tensors -> floats)."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.item()
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    return [{k: plain(v) for k, v in group.items()} for group in groups]


def saved_param_groups(saved: SavedComponent, live_groups: int) -> list[dict[str, Any]]:
    where = f"optimizer param groups of {saved.name} in {saved.path}"
    groups = saved.json.get(PARAM_GROUPS) if isinstance(saved.json, dict) else None
    if not isinstance(groups, list) or len(groups) != live_groups:
        found = len(groups) if isinstance(groups, list) else groups
        raise CheckpointError(f"{where}: expected {live_groups} groups, found {found!r}.")
    groups = [dict(group) for group in groups]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    return groups


def saved_stateless(
    saved: SavedComponent, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> set[str]:
    """The saved stateless parameters, each one the optimizer holds."""
    names = saved.json.get(STATELESS) if isinstance(saved.json, dict) else None
    held = {fqn for fqn, _ in trainable_named_params(model, optimizer)}
    if not isinstance(names, list) or not all(isinstance(n, str) and n in held for n in names):
        raise CheckpointError(
            f"the {STATELESS!r} list of {saved.name} in {saved.path} must name parameters this "
            f"optimizer holds, found {names!r}."
        )
    return set(names)


def check_loadable(state: dict[str, dict[str, Any]], expected: Inventory) -> None:
    """Refuse to save optimizer state (``{fqn: {key: tensor}}``) that a load would reject:
    every key of ``expected`` present with its global shape and dtype, nothing else."""
    found = {
        f"{fqn}.{key}": TensorSpec(tuple(value.shape), value.dtype)
        for fqn, entry in state.items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    if found != expected:
        problems = sorted(set(found) ^ set(expected)) or [
            f"{k} ({found[k]} vs {expected[k]})" for k in sorted(found) if found[k] != expected[k]
        ]
        raise CheckpointError(
            "the optimizer's state does not match what a load of it would expect (a "
            f"checkpoint of it could not be restored): {', '.join(problems[:8])}."
        )


class OptimizerState:
    """The per-parameter state and param groups of ``optimizer`` over ``model``'s parameters.

    ``layout``: the parallel layout of this run; saved state is accepted only from a
    compatible one (checkpoint.load_optimizer=false loads weights across any layout).
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: LayoutMetadata
    ) -> None:
        self.model, self.optimizer, self.layout = model, optimizer, layout

    def state(self) -> ComponentState:
        """The state DCP gathers, checked against the inventory a load will expect, so only a
        loadable checkpoint is ever written: every held parameter has its complete state, or
        none at all (recorded as stateless; it gets fresh state on its first real gradient)."""
        with dcp_state_init(self.optimizer):  # DCP's state-initialising step is no real step
            full = get_optimizer_state_dict(self.model, self.optimizer)
        state = full["state"]
        held = [fqn for fqn, _ in trainable_named_params(self.model, self.optimizer)]
        stateless = [fqn for fqn in held if not state.get(fqn)]
        check_loadable(state, optimizer_inventory(self.model, self.optimizer, stateless))
        groups = to_json_param_groups(full[PARAM_GROUPS])
        return ComponentState(tensors=state, json={PARAM_GROUPS: groups, STATELESS: stateless})

    def stage(self, saved: SavedComponent) -> Staged:
        saved_layout = LayoutMetadata.from_json(saved.layout)
        reason = saved_layout.optimizer_compatible(self.layout)
        if reason is not None:
            raise CheckpointError(
                f"optimizer state in {saved.path} cannot be loaded into this run: {reason}; "
                "resume with checkpoint.load_optimizer=false to load the model weights only."
            )
        groups = saved_param_groups(saved, len(self.optimizer.param_groups))
        stateless = saved_stateless(saved, self.model, self.optimizer)
        buffers = optimizer_buffers(self.model, self.optimizer, stateless)
        return Staged(
            expected=optimizer_inventory(self.model, self.optimizer, stateless),
            buffers=buffers,
            install=lambda: self._install(buffers, groups, strict=not stateless),
        )

    def _install(self, buffers: Buffers, groups: list[dict[str, Any]], *, strict: bool) -> None:
        """``strict=False`` when some parameters were saved stateless: DCP would otherwise
        refuse a trainable parameter without state (the inventory was checked exactly)."""
        optimizer = self.optimizer
        # A fresh optimizer has no state, so set_optimizer_state_dict would first run DCP's
        # zero-LR "init" step, allocating zero grads and placeholder masters/moments next to
        # the staged ones (resume peak memory above training's). Seeding the state with the
        # staged tensors skips that step; load_state_dict then validates and installs them.
        seeded = not optimizer.state
        if seeded:
            for fqn, param in trainable_named_params(self.model, optimizer):
                if fqn in buffers:
                    optimizer.state[param] = buffers[fqn]
        try:
            direct = self._state_dict_by_position(buffers, groups)
            if direct is not None:
                optimizer.load_state_dict(direct)
                return
            with dcp_state_init(optimizer):
                set_optimizer_state_dict(
                    self.model,
                    optimizer,
                    {"state": buffers, PARAM_GROUPS: groups},
                    options=StateDictOptions(strict=strict),
                )
        except BaseException:
            if seeded:
                optimizer.state.clear()
            raise

    def _state_dict_by_position(
        self, buffers: Buffers, groups: list[dict[str, Any]]
    ) -> dict[str, Any] | None:
        """The staged state as ``load_state_dict`` takes it, or None to go through DCP.

        What ``set_optimizer_state_dict`` hands a veoptim optimizer after mapping names:
        state keyed by name, each saved group listing its parameters' names in the live
        group's order (the optimizer maps them by position and validates every entry).
        Taken only where the saved groups list exactly the live groups' names in order;
        skipping DCP's re-derivation of every parameter's name is a third of a 100 MB
        load's install time.
        """
        if not isinstance(self.optimizer, ValidatedOptimizerMixin):
            return None
        names = {id(p): fqn for fqn, p in trainable_named_params(self.model, self.optimizer)}
        for saved, live in zip(groups, self.optimizer.param_groups, strict=True):
            if saved.get("params") != [names.get(id(p)) for p in live["params"]]:
                return None
        return {"state": buffers, PARAM_GROUPS: groups}
