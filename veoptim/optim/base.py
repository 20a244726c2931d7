"""What every veoptim AdamW type shares: group lookup, DCP's dummy step, validated loading.

A mixin, so ``AdamW`` keeps ``torch.optim.AdamW``'s arithmetic and ``ExactAdamW``
keeps its own; both get the same rules for which group owns a parameter, which
``step()`` call is DCP's state-initialising one (an explicit marker,
:func:`dcp_state_init`, never a guess from the values), what a state dict must
hold before any of it is installed, and which settings survive deepcopy/pickle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from veoptim.errors import CheckpointError
from veoptim.optim.checks import (
    ExpectedState,
    check_entry,
    check_groups,
    check_unstepped,
    param_name,
)

#: Saved state key -> (live parameter, its live param group, readable name).
Owners = dict[Any, tuple[torch.Tensor, dict[str, Any], str]]

#: Attribute holding how many :func:`dcp_state_init` blocks are open on an optimizer.
_DCP_INIT_DEPTH = "_veoptim_dcp_init_depth"


@contextlib.contextmanager
def dcp_state_init(optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    """Wrap DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` calls.

    Those functions create missing state by calling ``step()`` with zero gradients
    and lr 0. Inside this block such a step only creates placeholder state (step 0)
    and is not counted; outside it every ``step()`` is a real step, even one with
    lr 0 and zero gradients (as in ``torch.optim.AdamW``). Nestable; any optimizer
    may be passed (for non-veoptim optimizers the flag is simply unused).
    """
    depth = getattr(optimizer, _DCP_INIT_DEPTH, 0)
    setattr(optimizer, _DCP_INIT_DEPTH, depth + 1)
    try:
        yield optimizer
    finally:
        setattr(optimizer, _DCP_INIT_DEPTH, depth)


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
        """DCP's state-initialising step: only a ``step()`` inside :func:`dcp_state_init`.

        No heuristic: a real first step with every lr 0 and every gradient zero counts.
        """
        return getattr(self, _DCP_INIT_DEPTH, 0) > 0

    # ------------------------------------------------------------------ deepcopy / pickle
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _settings(self) -> dict[str, Any]:
        """Settings outside ``defaults``/``state``/``param_groups`` (what torch pickles)."""
        return {"param_names": [self.param_names.get(id(p)) for p in self._all_params()]}

    def _restore_settings(self, settings: Mapping[str, Any]) -> None:
        names = settings.get("param_names", [])
        self.param_names = {
            id(p): n for p, n in zip(self._all_params(), names, strict=False) if n is not None
        }

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["_veoptim_settings"] = self._settings()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        settings = state.pop("_veoptim_settings", None)
        super().__setstate__(state)  # type: ignore[misc]
        if settings is not None:  # torch's load_state_dict also calls __setstate__, without them
            self._restore_settings(settings)

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
            check_unstepped(name, p, entry)
        return owners
