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

What a training checkpoint version holds (``checkpoint.json`` records the components)::

    manifest.json             written last by the publisher; lists every file below
    checkpoint.json           format, format version, step, world size, parallel layout
                              and the list of state components with what each saved
    dcp/                      torch.distributed.checkpoint: tensors only, sharded by rank
      .metadata                 keys ``<component>.<key>``, e.g. ``model.<fqn>``
      __<rank>_<n>.distcp      one file per writer thread (checkpoint.write_threads)
    state/<component>.json    JSON state shared by all ranks (written by rank 0)
    state/<component>/rank_<r>.json   JSON state of rank r (e.g. RNG states)

No file is ever unpickled on load: tensors come from DCP shards (its metadata is
read with an allow-list unpickler), everything else is JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

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


# ---------------------------------------------------------------- checkpoint.json: files and keys
CHECKPOINT_FORMAT = "veoptim.training_checkpoint"
#: 2: named state components (version 1 had a fixed set of files; it is refused).
CHECKPOINT_FORMAT_VERSION = 2

INFO_FILE = "checkpoint.json"
DCP_DIR = "dcp"
STATE_DIR = "state"
SHARED_JSON_FORMAT = "{name}.json"
RANK_JSON_FORMAT = "rank_{rank:05d}.json"

# checkpoint.json keys
INFO_FORMAT = "format"
INFO_FORMAT_VERSION = "format_version"
INFO_STEP = "step"
INFO_WORLD_SIZE = "world_size"
INFO_LAYOUT = "layout"
#: True for a weights-only ("sampler") checkpoint: a subset of the run's components.
INFO_WEIGHTS_ONLY = "weights_only"
INFO_COMPONENTS = "components"
# per-component entry of checkpoint.json
COMPONENT_TENSORS = "tensors"
COMPONENT_JSON = "json"
JSON_SHARED = "shared"
JSON_PER_RANK = "per_rank"


def shared_json_path(version: Path, name: str) -> Path:
    """The JSON file of component ``name`` shared by every rank."""
    return version / STATE_DIR / SHARED_JSON_FORMAT.format(name=name)


def rank_json_path(version: Path, name: str, rank: int) -> Path:
    """The JSON file of component ``name`` written by ``rank``."""
    return version / STATE_DIR / name / RANK_JSON_FORMAT.format(rank=rank)


# ---------------------------------------------------------------- checks of a saved checkpoint against the live run (nothing live is touched)
def read_json(path: Path) -> Any:
    """Parse a JSON file of a checkpoint; missing or malformed files name the path."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing.") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON: {exc}.") from exc


def check_info(info: Any, path: Path) -> dict[str, Any]:
    """A known format and version, with a well-formed component list; returns ``info``."""
    where = path / INFO_FILE
    if not isinstance(info, dict) or info.get(INFO_FORMAT) != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{where} does not describe a veoptim training checkpoint (expected format "
            f"{CHECKPOINT_FORMAT!r}); it may be an export, which cannot be resumed from — "
            "start a fresh run from it with model.path instead."
        )
    version = info.get(INFO_FORMAT_VERSION)
    if version != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {version!r}; this veoptim reads format_version "
            f"{CHECKPOINT_FORMAT_VERSION} only — resume or export it with the veoptim release "
            "that wrote it (version 1 predates named state components), then start from the "
            "export with model.path."
        )
    components = info.get(INFO_COMPONENTS)
    if not isinstance(components, dict) or not all(
        isinstance(entry, dict) for entry in components.values()
    ):
        raise CheckpointError(f"{where} has no valid {INFO_COMPONENTS!r} mapping.")
    if not isinstance(info.get(INFO_STEP), int) or not isinstance(info.get(INFO_WORLD_SIZE), int):
        raise CheckpointError(f"{where} must record an integer step and world_size.")
    return info


@dataclass(frozen=True)
class SavedEntry:
    """One component a checkpoint holds, and the kinds of state it saved: tensors (in
    DCP) and JSON (``JSON_SHARED``, ``JSON_PER_RANK`` or None)."""

    name: str
    tensors: bool
    json: str | None


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``checkpoint.json`` records for a whole version, checked (:func:`read_info`)."""

    step: int
    world_size: int
    #: A weights-only ("sampler") checkpoint: a subset of the run's components.
    weights_only: bool
    components: tuple[str, ...]
    #: Each component with the kinds of state it saved, in ``components``' order.
    entries: tuple[SavedEntry, ...] = field(default=(), compare=False)


def read_info(version: Path) -> CheckpointInfo:
    """Read and check ``checkpoint.json`` of ``version`` (:func:`check_info`): the one
    reader for code outside the checkpointer that needs what a version holds."""
    info = check_info(read_json(version / INFO_FILE), version)
    return CheckpointInfo(
        step=info[INFO_STEP],
        world_size=info[INFO_WORLD_SIZE],
        weights_only=bool(info.get(INFO_WEIGHTS_ONLY)),
        components=tuple(info[INFO_COMPONENTS]),
        entries=tuple(
            SavedEntry(name, bool(entry.get(COMPONENT_TENSORS)), entry.get(COMPONENT_JSON))
            for name, entry in info[INFO_COMPONENTS].items()
        ),
    )


def check_components(
    saved: Collection[str], wanted: Collection[str], path: Path, *, exact: bool
) -> None:
    """Every wanted component saved; with ``exact``, nothing saved that the run lacks."""
    missing = sorted(set(wanted) - set(saved))
    unknown = sorted(set(saved) - set(wanted)) if exact else []
    problems = []
    if missing:
        problems.append(f"it has no state for {', '.join(missing)}")
    if unknown:
        problems.append(f"it holds state this run does not have: {', '.join(unknown)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not match the live run's state components "
            f"({', '.join(sorted(wanted))}): " + "; ".join(problems) + "."
        )


# ---------------------------------------------------------------- tensor inventories
MAX_LISTED = 8


def saved_inventory(metadata: Metadata, prefix: str, where: Path) -> Inventory:
    """Specs of the tensors stored under ``<prefix>.`` (keys without the prefix)."""
    saved: Inventory = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(prefix + "."):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {where} stores {key!r} as non-tensor data.")
        saved[key[len(prefix) + 1 :]] = TensorSpec(tuple(entry.size), entry.properties.dtype)
    return saved


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def compare_inventory(expected: Inventory, saved: Inventory, where: Path) -> None:
    """Raise one CheckpointError listing every missing, unexpected or mismatched tensor."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = [
        f"{key} (expected {expected[key]}, found {saved[key]})"
        for key in sorted(set(expected) & set(saved))
        if expected[key] != saved[key]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_listed(unexpected)}")
    if mismatched:
        problems.append(
            f"{len(mismatched)} tensor(s) with another shape/dtype: {_listed(mismatched)}"
        )
    if problems:
        raise CheckpointError(
            f"checkpoint {where} does not match the live run: " + "; ".join(problems) + "."
        )


def prefixed(prefix: str, inventory: Inventory) -> Inventory:
    """``inventory`` with every key under ``<prefix>.`` (how DCP names nested keys)."""
    return {f"{prefix}.{key}": spec for key, spec in inventory.items()}
