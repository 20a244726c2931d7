"""Checks of a checkpoint's description against the live run (no live state is touched)."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from veoptim.checkpoint import contents as C
from veoptim.errors import CheckpointError


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
    where = path / C.INFO_FILE
    if not isinstance(info, dict) or info.get(C.INFO_FORMAT) != C.CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{where} does not describe a veoptim training checkpoint (expected format "
            f"{C.CHECKPOINT_FORMAT!r}); it may be an export, which cannot be resumed from — "
            "start a fresh run from it with model.path instead."
        )
    version = info.get(C.INFO_FORMAT_VERSION)
    if version != C.CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {version!r}; this veoptim reads format_version "
            f"{C.CHECKPOINT_FORMAT_VERSION} only — resume or export it with the veoptim release "
            "that wrote it (version 1 predates named state components), then start from the "
            "export with model.path."
        )
    components = info.get(C.INFO_COMPONENTS)
    if not isinstance(components, dict) or not all(
        isinstance(entry, dict) for entry in components.values()
    ):
        raise CheckpointError(f"{where} has no valid {C.INFO_COMPONENTS!r} mapping.")
    if not isinstance(info.get(C.INFO_STEP), int) or not isinstance(
        info.get(C.INFO_WORLD_SIZE), int
    ):
        raise CheckpointError(f"{where} must record an integer step and world_size.")
    return info


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
