"""An object with ``state_dict`` / ``load_state_dict`` kept as JSON (scheduler, sampler, progress)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

from veoptim.checkpoint import ComponentState, SavedComponent, Staged
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


def _structure_problem(live: Any, saved: Any, where: str) -> str | None:
    """Where ``saved`` differs from ``live`` in shape: keys, list lengths, value types."""
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            return f"{where}: expected a mapping, found {type(saved).__name__}"
        if set(saved) != set(live):
            return f"{where}: keys {sorted(saved)}, expected {sorted(live)}"
        for key in live:
            problem = _structure_problem(live[key], saved[key], f"{where}.{key}")
            if problem:
                return problem
        return None
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(live):
            found = len(saved) if isinstance(saved, list) else type(saved).__name__
            return f"{where}: expected a list of {len(live)}, found {found}"
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            problem = _structure_problem(a, b, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(live, bool) or isinstance(saved, bool) or live is None or saved is None:
        fits = type(live) is type(saved)
    elif isinstance(live, (int, float)):
        fits = isinstance(saved, (int, float))  # JSON keeps no int/float distinction for us
    else:
        fits = type(live) is type(saved)
    return None if fits else f"{where}: {saved!r} where a {type(live).__name__} is expected"


def same_structure(obj: Stateful, saved: Any, where: str) -> None:
    """For objects too entangled to copy (an LR scheduler holds its optimizer): the saved
    state must have the live state's structure — the same keys, list lengths (one entry
    per param group) and value types — so installing it cannot fail half-way."""
    problem = _structure_problem(obj.state_dict(), saved, "state")
    if problem:
        raise CheckpointError(f"{where} does not fit the live object: {problem}.")


class JSONState:
    """Saves ``obj.state_dict()`` as JSON; a load is checked by ``check`` before installing."""

    def __init__(self, obj: Stateful, check: Check = load_into_copy) -> None:
        self.obj, self.check = obj, check

    def state(self) -> ComponentState:
        return ComponentState(json=self.obj.state_dict())

    def stage(self, saved: SavedComponent) -> Staged:
        self.check(self.obj, saved.json, f"{saved.name} state in {saved.path}")
        return Staged(install=lambda: self.obj.load_state_dict(saved.json))
