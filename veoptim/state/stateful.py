"""An object with ``state_dict`` / ``load_state_dict`` kept as JSON (scheduler, sampler, progress)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

from veoptim.checkpoint.component import ComponentState, SavedComponent, Staged
from veoptim.errors import CheckpointError


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


#: Raises CheckpointError if a saved state cannot be loaded into the live object.
Check = Callable[[Stateful, Any, str], None]


def load_into_copy(obj: Stateful, saved: Any, where: str) -> None:
    """The default check: load into a deep copy, so a malformed state fails before mutation."""
    try:
        copy.deepcopy(obj).load_state_dict(saved)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}.") from exc


def same_keys(obj: Stateful, saved: Any, where: str) -> None:
    """For objects too entangled to copy (an LR scheduler holds its optimizer): the saved
    state must have exactly the live state's keys."""
    live = obj.state_dict()
    if not isinstance(saved, dict) or set(saved) != set(live):
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(f"{where} has keys {found}, expected {sorted(live)}.")


class JSONState:
    """Saves ``obj.state_dict()`` as JSON; a load is checked by ``check`` before installing."""

    def __init__(self, obj: Stateful, check: Check = load_into_copy) -> None:
        self.obj, self.check = obj, check

    def state(self) -> ComponentState:
        return ComponentState(json=self.obj.state_dict())

    def stage(self, saved: SavedComponent) -> Staged:
        self.check(self.obj, saved.json, f"{saved.name} state in {saved.path}")
        return Staged(install=lambda: self.obj.load_state_dict(saved.json))
