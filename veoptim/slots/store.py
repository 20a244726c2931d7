"""Where slot checkpoints live, and how a reference to one is resolved.

Layout: ``<slots root>/<name>/`` per slot checkpoint name (one tenant's), holding one
published checkpoint per save, named ``save_<6 digits>`` (relative links to immutable
versions, see ``docs/checkpoints.md``). A save never re-points an older save, so
repeated saves of one name are distinct versions, and ``keep_last`` prunes within that
name's directory only: one tenant's retention cannot reach another's saves.

A reference is ``<name>`` (its newest complete save), ``<name>/save_000003`` (that
save), or a path inside the slots root (e.g. the version directory a save returned).
Names are validated and anything resolving outside the root is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from veoptim.checkpoint import (
    Checkpointer,
    FaultHook,
    Published,
    StateComponent,
    is_within,
    newest_complete,
    published_names,
    read_info,
    remove_root,
    resolve,
    resolve_path,
    validate_name,
)
from veoptim.distributed.agreement import on_rank0
from veoptim.errors import CheckpointError

SAVE_NAME = "save_{:06d}"
_SAVE_PATTERN = re.compile(r"^save_(\d{6,})$")


class SlotStore:
    """The naming policy of slot checkpoints over one ``Checkpointer`` rooted at the slots
    root (collective calls): a name is a root of its own, a save its next ``save_<n>``."""

    def __init__(
        self,
        root: Path,
        *,
        keep_last: int = 0,
        fsync: bool = True,
        write_threads: int = 2,
        group: Any = None,
    ) -> None:
        self.group = group
        self.checkpointer = Checkpointer(
            root, keep_last=keep_last, fsync=fsync, write_threads=write_threads, group=group
        )

    @property
    def root(self) -> Path:
        """The slots root: one directory per slot checkpoint name."""
        return self.checkpointer.root

    @property
    def fault_hook(self) -> FaultHook | None:
        """Called at every save/load phase (tests inject failures with it)."""
        return self.checkpointer.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: FaultHook | None) -> None:
        self.checkpointer.fault_hook = hook

    def save(
        self,
        name: str,
        components: Mapping[str, StateComponent],
        *,
        layout: dict[str, Any],
        weights_only: bool,
    ) -> Published:
        """Publish ``components`` as the next save of ``name``."""
        sequence = self._next_sequence(self.root / validate_name(name))
        published = self.checkpointer.save(
            components,
            SAVE_NAME.format(sequence),
            step=sequence,
            layout=layout,
            weights_only=weights_only,
            within=name,
        )
        assert published is not None  # a synchronous save publishes or raises
        return published

    def load(self, components: Mapping[str, StateComponent], path: Path, *, exact: bool) -> None:
        """Validate, read and apply ``path`` into ``components`` (the checkpointer's phases)."""
        self.checkpointer.load(components, path, exact=exact)

    def delete(self, name: str) -> None:
        """Delete slot checkpoint ``name``, every save of it: the manifests first, as
        retention removes versions, so a reader never takes a half-deleted save for a
        complete one (rank 0 removes; agreed)."""
        root = self.root / validate_name(name)
        on_rank0(lambda: remove_root(root), f"deleting slot checkpoint {name!r}", self.group)

    def names(self) -> list[str]:
        """Every slot checkpoint name in the store, published or not (rank 0 lists; agreed)."""

        def listing() -> list[str]:
            if not self.root.is_dir():
                return []
            return sorted(e.name for e in self.root.iterdir() if e.is_dir() and not e.is_symlink())

        return on_rank0(listing, f"listing the slot checkpoints in {self.root}", self.group)

    def _next_sequence(self, root: Path) -> int:
        """1 + the highest save number published under ``root`` (rank 0 looks; agreed)."""

        def next_number() -> int:
            numbers = [
                int(m.group(1))
                for n in published_names(root)
                if (m := _SAVE_PATTERN.match(n)) is not None
            ]
            return max(numbers, default=0) + 1

        return on_rank0(next_number, f"listing the saves in {root}", self.group)

    def resolve(self, ref: str | os.PathLike[str]) -> tuple[Path, bool]:
        """The complete version ``ref`` names and whether it is weights-only (rank 0
        resolves once, verifying the version's manifest once; agreed)."""

        def find() -> tuple[str, bool]:
            path = self._resolve_here(ref)
            return str(path), read_info(path).weights_only

        path_text, weights_only = on_rank0(
            find, f"resolving slot checkpoint {str(ref)!r}", self.group
        )
        return Path(path_text), weights_only

    def _resolve_here(self, ref: str | os.PathLike[str]) -> Path:
        text = os.fspath(ref)
        if not os.path.isabs(text):
            parts = text.split("/")
            if len(parts) > 2:
                raise CheckpointError(
                    f"slot checkpoint reference {text!r} must be '<name>', '<name>/<save>' or a "
                    f"path inside {self.root}."
                )
            name_root = self.root / validate_name(parts[0])
            if len(parts) == 2:
                return resolve(name_root, validate_name(parts[1]))
            newest = newest_complete(name_root)  # the version, verified complete once
            if newest is None:
                raise CheckpointError(
                    f"there is no complete slot checkpoint named {parts[0]!r} in {self.root}."
                )
            return newest[1]
        path = Path(text)
        if not is_within(path.parent, self.root):
            raise CheckpointError(
                f"slot checkpoint path {path} is outside the slot checkpoint root {self.root}."
            )
        resolved = resolve_path(path)
        if not is_within(resolved, self.root):
            raise CheckpointError(
                f"slot checkpoint path {path} resolves to {resolved}, outside the slot "
                f"checkpoint root {self.root}."
            )
        return resolved
