"""Fault hooks: named points in a save where tests inject a failure or a crash.

A hook is called with a phase name when a save reaches that point; whatever it raises (or
a ``SIGKILL`` it sends) is a fault at exactly that point. Production code passes no hook.
The publication phases are listed here, in the order a save reaches them, so that the
crash and fault tests can iterate over all of them.
"""

from __future__ import annotations

from collections.abc import Callable

FaultHook = Callable[[str], None]

PHASE_PREPARED = "prepared"  # every rank, after the version directory exists
PHASE_WRITTEN = "written"  # every rank, after the caller's writes, before their fsync
PHASE_BEFORE_MANIFEST = "before_manifest"  # rank 0, every rank's files are in
PHASE_AFTER_MANIFEST = "after_manifest"  # rank 0, manifest written and flushed, name unmoved
PHASE_BEFORE_REPLACE = "before_replace"  # rank 0, the temporary link exists
PHASE_AFTER_REPLACE = "after_replace"  # rank 0, the name points to the new version
PHASE_RETENTION = "retention"  # rank 0, before retention removes a name or a version

PHASES = (
    PHASE_PREPARED,
    PHASE_WRITTEN,
    PHASE_BEFORE_MANIFEST,
    PHASE_AFTER_MANIFEST,
    PHASE_BEFORE_REPLACE,
    PHASE_AFTER_REPLACE,
    PHASE_RETENTION,
)


def fire(hook: FaultHook | None, phase: str) -> None:
    """Call ``hook`` with ``phase`` if a hook is set (tests only)."""
    if hook is not None:
        hook(phase)
