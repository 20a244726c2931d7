"""Checkpoint layout, crash-atomic publication, readers and retention (see docs/checkpoints.md)."""

from veoptim.checkpoint.layout import step_name, validate_name
from veoptim.checkpoint.publish import PendingVersion, Published, Publisher
from veoptim.checkpoint.resolve import (
    latest_complete,
    resolve,
    resolve_agreed,
    resolve_path,
    resolve_reference,
    resolve_version,
)

__all__ = [
    "PendingVersion",
    "Published",
    "Publisher",
    "latest_complete",
    "resolve",
    "resolve_agreed",
    "resolve_path",
    "resolve_reference",
    "resolve_version",
    "step_name",
    "validate_name",
]
