"""Checks of a checkpoint's non-tensor files against the live run (no live state is touched)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from veoptim.checkpoint import format as F
from veoptim.errors import CheckpointError


def read_json(path: Path) -> Any:
    """Parse a JSON file of a checkpoint; missing or malformed files name the path."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint file {path} is missing.") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON: {exc}.") from exc


def check_info(info: Any, path: Path, load_optimizer: bool) -> None:
    """Known format and version; optimizer state present when it is asked for."""
    where = path / F.INFO_FILE
    if not isinstance(info, dict) or info.get(F.INFO_FORMAT) != F.CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{where} does not describe a veoptim training checkpoint (expected format "
            f"{F.CHECKPOINT_FORMAT!r}); it may be an export or a legacy layout, which cannot be "
            "resumed from — convert it or start a fresh run."
        )
    version = info.get(F.INFO_FORMAT_VERSION)
    if version != F.CHECKPOINT_FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {version!r}; this veoptim reads version "
            f"{F.CHECKPOINT_FORMAT_VERSION} only — use the veoptim release that wrote it."
        )
    if load_optimizer and not info.get(F.INFO_HAS_OPTIMIZER, False):
        raise CheckpointError(
            f"{path} holds no optimizer state (a weights-only checkpoint); resume with "
            "checkpoint.load_optimizer=false."
        )


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return "<absent>"
        value = value[part]
    return value


def _flatten(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(f"{prefix}.{k}", v))
        return out
    return {prefix: value}


def check_config(saved: Any, live: dict[str, Any], path: Path, load_optimizer: bool) -> None:
    """The config keys that decide data order, schedule and state must match (``format``)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / F.CONFIG_FILE} is not a config mapping.")
    keys = F.RESUME_MUST_MATCH if load_optimizer else F.WEIGHTS_ONLY_MUST_MATCH
    saved_flat: dict[str, Any] = {}
    live_flat: dict[str, Any] = {}
    for key in keys:
        saved_flat.update(_flatten(key, _lookup(saved, key)))
        live_flat.update(_flatten(key, _lookup(live, key)))
    diffs = [
        f"{k}: saved {saved_flat.get(k, '<absent>')!r}, live {live_flat.get(k, '<absent>')!r}"
        for k in sorted(set(saved_flat) | set(live_flat))
        if saved_flat.get(k, "<absent>") != live_flat.get(k, "<absent>")
    ]
    if diffs:
        hint = (
            "" if not load_optimizer else " (checkpoint.load_optimizer=false resumes weights only)"
        )
        raise CheckpointError(
            f"checkpoint {path} was written by a run with a different config: "
            + "; ".join(diffs)
            + hint
            + "."
        )
