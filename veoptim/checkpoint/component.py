"""The contract between the checkpointer and the state it saves: named components.

A checkpoint holds a mapping ``name -> component``. The checkpointer knows no
component by name; each component says what it saves, checks a saved state
against itself without touching anything live, and installs it afterwards:

- :meth:`StateComponent.state` gives tensors (written with DCP under
  ``<name>.<key>``) and/or a JSON value (one shared file, or one per rank).
- :meth:`StateComponent.stage` gets what the checkpoint holds for it
  (:class:`SavedComponent`) and returns a :class:`Staged` load: the tensor
  inventory it expects, fresh buffers for DCP to read into, and an ``install``
  that copies the staged values into the live object. ``stage`` raises
  ``CheckpointError`` for anything it would reject, and must not mutate.

A load stages every component (validation), reads every buffer (read), and
only then calls every ``install`` (apply), each phase ending in cross-rank
agreement; so a rejected checkpoint leaves the live run unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from veoptim.errors import CheckpointError

#: Component names are DCP key prefixes and file names: lower-case identifiers, no dots.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of one checkpoint tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


#: Tensor key (relative to the component, dots for nesting) -> global spec.
Inventory = dict[str, TensorSpec]


@dataclass
class ComponentState:
    """What a component saves: a (possibly nested, sharded) DCP state dict and/or JSON."""

    tensors: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    #: True: every rank writes its own JSON (e.g. RNG states); False: rank 0's is shared.
    json_per_rank: bool = False


@dataclass(frozen=True)
class SavedComponent:
    """What a checkpoint holds for one component, as its ``stage`` sees it.

    ``json`` is the shared JSON, or this rank's (None when the checkpoint was saved on
    fewer ranks than this run has); ``tensors`` the saved inventory under the component's
    prefix; ``step``, ``world_size`` and ``layout`` (the parallel layout's JSON, None if
    none was recorded) what the checkpoint records for the whole save, read and checked by
    the checkpointer: no component parses ``checkpoint.json`` itself.
    """

    name: str
    path: Path
    json: Any
    tensors: Inventory
    step: int
    world_size: int
    layout: Any = None


def _nothing() -> None:
    return None


@dataclass
class Staged:
    """A validated load of one component, installed only after every component staged."""

    expected: Inventory = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    install: Callable[[], None] = _nothing


class StateComponent(Protocol):
    """One named piece of checkpointed state (see the module docstring)."""

    def state(self) -> ComponentState: ...

    def stage(self, saved: SavedComponent) -> Staged: ...


def check_component_name(name: str) -> str:
    """Return ``name`` if it can be a component name, else raise naming the rule."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise CheckpointError(
            f"state component name {name!r} must be a lower-case identifier "
            "(letters, digits, underscores; no dots), at most 64 characters."
        )
    return name
