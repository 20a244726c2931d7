"""What every veoptim AdamW type shares: group lookup, DCP's dummy step, validated loading.

A mixin, so ``AdamW`` keeps ``torch.optim.AdamW``'s arithmetic and ``ExactAdamW``
keeps its own; both get the same rules for which group owns a parameter, which
``step()`` call is DCP's state-initialising one, and what a state dict must hold
before any of it is installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from veoptim.errors import CheckpointError
from veoptim.optim.dtensor_util import local
from veoptim.optim.state_check import ExpectedState, check_entry, check_groups, param_name

#: Saved state key -> (live parameter, its live param group, readable name).
Owners = dict[Any, tuple[torch.Tensor, dict[str, Any], str]]


class ValidatedOptimizerMixin:
    """Put before a ``torch.optim.Optimizer`` base; subclasses define ``expected_state``."""

    param_names: dict[int, str]
    param_groups: list[dict[str, Any]]
    state: Any

    def expected_state(self, param: torch.Tensor) -> ExpectedState:
        raise NotImplementedError

    def _name(self, p: torch.Tensor) -> str:
        """The model FQN for messages, or the shape when no name was given."""
        return self.param_names.get(id(p), f"a parameter of shape {tuple(p.shape)}")

    def _group_of(self, param: torch.Tensor) -> dict[str, Any]:
        """The live param group holding ``param`` (by identity); KeyError if none does."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise KeyError(f"{self._name(param)} is not managed by this optimizer.")

    def _is_dcp_dummy_step(self) -> bool:
        """DCP's state-initialising step: no state yet, every lr 0 and every gradient zero.

        ``torch.distributed.checkpoint.state_dict`` takes such a step to create state
        before loading into it; it must not count as a real step.
        """
        if self.state:
            return False
        if any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        grads = [
            local(p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None
        ]
        return bool(grads) and not any(bool(g.any()) for g in grads)

    def _validated_owners(self, state_dict: Mapping[str, Any]) -> Owners:
        """Check groups and every state entry; map each saved key to its live parameter.

        Raises CheckpointError before anything is installed, so a rejected state dict
        leaves the optimizer untouched. Nothing is cast.
        """
        saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
        check_groups(self.param_groups, saved_groups)
        if not isinstance(saved_state, Mapping):
            raise CheckpointError("Optimizer state dict has no 'state' mapping.")
        owners: Owners = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            for pi, (key, p) in enumerate(zip(saved["params"], group["params"], strict=True)):
                owners[key] = (p, group, param_name(self.param_names, p, gi, pi))
        for key, entry in saved_state.items():
            if key not in owners:
                raise CheckpointError(
                    f"Optimizer state has an entry for {key!r}, which no param group lists."
                )
            p, _, name = owners[key]
            check_entry(name, p, entry, self.expected_state(p))
        return owners
