"""Which run a run dir holds: ``<run.dir>/run.json``, its run id and where it came from.

A fresh start creates a run id; every checkpoint and export the run publishes records it
(the manifest's ``run``), and a full resume continues it. ``checkpoint.resume=auto`` reads
this record and considers only checkpoints of that run, so a previous run's checkpoints
left in the same root (after ``checkpoint.overwrite=true``) are never resumed by accident.

The record is small JSON, replaced atomically (a temporary file, fsync, ``os.replace``),
so a crash leaves the old or the new record, never a torn one::

    {"format": "veoptim.run", "format_version": 1,
     "run_id": "20261204-173600-3f2a9c1d", "created": "2026-12-04T17:36:00+00:00",
     "origin": "fresh" | "resumed" | "warm_start",
     "source": {"checkpoint": "...", "run_id": "..." | null, "step": 10} | null}
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from veoptim.errors import ConfigError

RUN_FILE = "run.json"
RUN_FORMAT = "veoptim.run"
RUN_FORMAT_VERSION = 1
RUN_ID_PATTERN = re.compile(r"\d{8}-\d{6}-[0-9a-f]{8}")

ORIGIN_FRESH = "fresh"  # no checkpoint loaded: a new run
ORIGIN_RESUMED = "resumed"  # the whole state of a checkpoint: that run continues
ORIGIN_WARM_START = "warm_start"  # weights only, or a checkpoint that records no run
ORIGINS = (ORIGIN_FRESH, ORIGIN_RESUMED, ORIGIN_WARM_START)


def new_run_id() -> str:
    """``<UTC date>-<UTC time>-<8 random hex digits>``: sortable by start, unique."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


@dataclass(frozen=True)
class RunSource:
    """The checkpoint a run started from: its path, the run that wrote it, its step."""

    checkpoint: str
    run_id: str | None
    step: int


@dataclass(frozen=True)
class RunIdentity:
    """One run dir's run: its id, when this record was made, and how the run began."""

    run_id: str
    created: str
    origin: str = ORIGIN_FRESH
    source: RunSource | None = None

    @classmethod
    def fresh(cls, origin: str = ORIGIN_FRESH, source: RunSource | None = None) -> RunIdentity:
        return cls(new_run_id(), time.strftime("%Y-%m-%dT%H:%M:%S%z"), origin, source)

    def continued_as(self, run_id: str, source: RunSource) -> RunIdentity:
        """This run dir now continues ``run_id`` (a full resume of its checkpoint)."""
        return RunIdentity(run_id, time.strftime("%Y-%m-%dT%H:%M:%S%z"), ORIGIN_RESUMED, source)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": RUN_FORMAT,
            "format_version": RUN_FORMAT_VERSION,
            **asdict(self),
        }


def run_file(run_dir: str | Path) -> Path:
    return Path(run_dir) / RUN_FILE


def _parse(raw: Any, where: Path) -> RunIdentity:
    if not isinstance(raw, dict) or raw.get("format") != RUN_FORMAT:
        raise ConfigError(f"{where} is not a veoptim run record (expected format {RUN_FORMAT!r}).")
    if raw.get("format_version") != RUN_FORMAT_VERSION:
        raise ConfigError(
            f"{where} has run record version {raw.get('format_version')!r}; this veoptim "
            f"reads version {RUN_FORMAT_VERSION}."
        )
    run_id, origin, source = raw.get("run_id"), raw.get("origin"), raw.get("source")
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise ConfigError(
            f"{where}: run_id must look like 20261204-173600-3f2a9c1d, got {run_id!r}."
        )
    if origin not in ORIGINS:
        raise ConfigError(f"{where}: origin must be one of {list(ORIGINS)}, got {origin!r}.")
    try:
        parsed = None if source is None else RunSource(**source)
    except TypeError as exc:
        raise ConfigError(f"{where}: malformed source {source!r}.") from exc
    return RunIdentity(run_id, str(raw.get("created", "")), origin, parsed)


def read_identity(run_dir: str | Path) -> RunIdentity | None:
    """The run dir's record; None when it has none (a new dir, or one from before run ids).
    A malformed record is a ``ConfigError`` naming the file: never guessed around."""
    path = run_file(run_dir)
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read the run record {path}: {exc}; delete it to let this run dir's "
            "next run start a new run id."
        ) from exc
    return _parse(raw, path)


def write_identity(run_dir: str | Path, identity: RunIdentity, *, fsync: bool = True) -> Path:
    """Replace the run dir's record atomically (the old or the new one survives a crash)."""
    path = run_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
    data = (json.dumps(identity.to_json(), indent=1) + "\n").encode()
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path
