"""``tinker://`` checkpoint references and model ids.

A training run is a model: its id is ``{session_id}:train:{model_seq_id}`` (what the SDK
derives for a model created by a load). A checkpoint is
``tinker://{training_run_id}/weights/{name}`` (training state, with optimizer) or
``tinker://{training_run_id}/sampler_weights/{name}`` (adapter weights only). Names are
the client's and live only in the database: on disk every checkpoint has a server-made
name in the slot store, so no client text ever becomes a file path.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from veoptim.service.db import Checkpoint, CheckpointKind, Database
from veoptim.service.errors import NotFound, ServiceError

SCHEME = "tinker://"
#: path segment <-> checkpoint kind (the SDK's ParsedCheckpointTinkerPath).
SEGMENTS = {"weights": CheckpointKind.TRAINING, "sampler_weights": CheckpointKind.WEIGHTS_ONLY,
            "external_weights": CheckpointKind.EXTERNAL}  # fmt: skip
#: The kinds a slot loads (an external checkpoint is a PEFT export, for download only).
LOADABLE = (CheckpointKind.TRAINING, CheckpointKind.WEIGHTS_ONLY)
KIND_SEGMENT = {kind: segment for segment, kind in SEGMENTS.items()}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


def new_store_ref() -> str:
    """A fresh slot-store entry name (``errors.STORE_REF`` recognises them)."""
    return f"c{uuid.uuid4().hex[:20]}"


def check_name(name: object, field: str = "path") -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise ServiceError(
            f"{field} must be a checkpoint name of letters, digits, '.', '_' and '-' (at most "
            f"128, starting with a letter or digit), got {name!r}."
        )
    return name


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: CheckpointKind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND_SEGMENT[self.kind]}/{self.name}"

    @property
    def path(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.checkpoint_id}"


def parse(path: object, field: str = "path", kinds: tuple[CheckpointKind, ...] = LOADABLE,
          ) -> CheckpointRef:  # fmt: skip
    """The reference ``path`` names, of one of ``kinds``; a malformed one is refused
    naming ``field``."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise ServiceError(f"{field} must be a tinker:// checkpoint path, got {path!r}.")
    parts = path[len(SCHEME) :].split("/")
    segments = [KIND_SEGMENT[kind] for kind in kinds]
    if len(parts) != 3 or parts[1] not in segments or not RUN_ID.fullmatch(parts[0]):
        forms = " or ".join(f"tinker://<training_run_id>/{segment}/<name>" for segment in segments)
        raise ServiceError(f"{field} must be {forms}, got {path!r}.")
    return CheckpointRef(parts[0], SEGMENTS[parts[1]], check_name(parts[2], field))


def parse_checkpoint_id(run_id: str, checkpoint_id: str) -> CheckpointRef:
    """``weights/<name>`` or ``sampler_weights/<name>`` of run ``run_id``."""
    segment, _, name = checkpoint_id.partition("/")
    if segment not in SEGMENTS or not NAME.fullmatch(name):
        raise NotFound(f"training run {run_id} has no checkpoint {checkpoint_id!r}.")
    return CheckpointRef(run_id, SEGMENTS[segment], name)


def find(db: Database, tenant_id: int, ref: CheckpointRef, field: str = "path") -> Checkpoint:
    """The tenant's checkpoint ``ref`` names; another tenant's is not found, like one that
    does not exist."""
    found = db.checkpoint(tenant_id, ref.run_id, ref.kind, ref.name)
    if found is None:
        raise NotFound(f"{field}: checkpoint {ref.path} was not found.")
    return found
