"""Fault hooks: the named points of a save or a load where tests inject a failure or a crash.

A hook is called with a phase name when a save or a load reaches that point; whatever it
raises (or a ``SIGKILL`` it sends) is a fault at exactly that point. Production code passes
no hook. Every phase is named here, once: the publication's (``PHASES``, in the order a
save reaches them, so the crash and fault tests can iterate over all of them), the
checkpointer's own around them (``SAVE_PHASES``), and a load's (``LOAD_PHASES``; ``apply``
fires once, then ``apply:<component>`` after each component is installed).

Nothing here runs during a save or a load without a hook. The publication reports its
phases to its storage seam (``StoreFiles.reached``, nothing to do on disk); a publisher
given a hook wraps its seam in :func:`with_faults`, which calls the hook there. The
checkpointer calls its hook itself, at its own phases, when it has one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FaultHook = Callable[[str], None]

PHASE_GATHER = "gather"  # every rank, before the components' state is gathered
PHASE_WRITER = "writer"  # every rank, before the DCP storage writer is created
PHASE_WRITE = "write"  # every rank, after dcp.save wrote this rank's files
PHASE_VALIDATE = "validate"  # every rank, after the checkpoint is validated and staged
PHASE_READ = "read"  # every rank, after dcp.load into the staging buffers
PHASE_APPLY = "apply"  # every rank, before the first component is installed
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
#: A checkpointer's save, in order: the publication's first phase, its own, then the rest.
SAVE_PHASES = (PHASE_PREPARED, PHASE_GATHER, PHASE_WRITER, PHASE_WRITE, *PHASES[1:])
LOAD_PHASES = (PHASE_VALIDATE, PHASE_READ, PHASE_APPLY)


class _FaultingFiles:
    """A storage seam that calls ``hook`` at every phase reached, then behaves like
    ``files`` (every other operation is ``files``')."""

    def __init__(self, files: Any, hook: FaultHook) -> None:
        self.files, self.hook = files, hook

    def reached(self, phase: str) -> None:
        self.hook(phase)
        self.files.reached(phase)

    def __getattr__(self, name: str) -> Any:
        if name in ("files", "hook"):  # not set yet (e.g. while unpickling)
            raise AttributeError(name)
        return getattr(self.files, name)


def with_faults(files: Any, hook: FaultHook) -> Any:
    """``files`` (a ``disk.StoreFiles``) with ``hook`` called at every phase reached."""
    return _FaultingFiles(files, hook)
