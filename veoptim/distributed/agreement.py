"""Cross-rank agreement: one collective that ends every checkpoint phase.

Each rank passes ``True`` or the exception it caught; every rank learns every outcome in a
single ``all_gather_object`` and, if any rank failed, raises the *same* ``CheckpointError``
naming the failing rank(s) and their causes. Because every rank always reaches the
collective (success or failure), no rank waits on a peer that gave up.

Without an initialised process group (or with a world of one) the call is local: it raises
only if this process failed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from veoptim.errors import CheckpointError

CAUSE_MAX_CHARS = 600
T = TypeVar("T")


def _describe(ok: bool | BaseException) -> str | None:
    if ok is True:
        return None
    if isinstance(ok, BaseException):
        text = f"{type(ok).__name__}: {ok}"
        return text if len(text) <= CAUSE_MAX_CHARS else text[: CAUSE_MAX_CHARS - 3] + "..."
    return "reported failure"


def _dist() -> Any | None:
    """torch.distributed if a process group can exist; None otherwise.

    Reading ``sys.modules`` avoids importing torch (about a second) in processes that never
    used it: if torch.distributed was never imported, no process group can be initialised.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def world_size(group: Any = None) -> int:
    dist = _dist()
    return 1 if dist is None else dist.get_world_size(group)


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    dist = _dist()
    return 0 if dist is None else dist.get_rank(group)


def _format(what: str, failures: list[tuple[int, str]], world: int) -> str:
    ranks = ", ".join(str(r) for r, _ in failures)
    noun = "rank" if len(failures) == 1 else "ranks"
    if len(failures) == 1:
        causes = failures[0][1]
    else:
        causes = "; ".join(f"rank {r}: {cause}" for r, cause in failures)
    return f"{what} failed on {noun} {ranks} of {world}: {causes}"


def agree(ok: bool | BaseException, what: str, group: Any = None) -> None:
    """Raise the same ``CheckpointError`` on every rank of ``group`` if any rank failed.

    ``ok`` is ``True`` for success, or the exception (or ``False``) for failure. ``what``
    names the phase, e.g. ``"checkpoint 'step_00000100' write"``. Ranks are reported as
    global ranks. Collective: every rank of ``group`` must call it with the same ``what``.
    """
    cause = _describe(ok)
    chained = ok if isinstance(ok, BaseException) else None
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        if cause is not None:
            raise CheckpointError(_format(what, [(rank(group), cause)], 1)) from chained
        return
    world = dist.get_world_size(group)
    gathered: list[str | None] = [None] * world
    try:
        dist.all_gather_object(gathered, cause, group=group)
    except Exception as exc:  # a peer died or the transport broke: still fail loudly
        raise CheckpointError(
            f"{what}: the agreement between ranks failed ({type(exc).__name__}: {exc}); "
            f"this rank's own outcome was {cause or 'success'}."
        ) from exc
    failures = [
        (dist.get_global_rank(group, r) if group is not None else r, c)
        for r, c in enumerate(gathered)
        if c is not None
    ]
    if failures:
        raise CheckpointError(_format(what, failures, world)) from chained


@contextmanager
def agreed(what: str, group: Any = None) -> Iterator[None]:
    """Run the block on every rank of ``group``, then :func:`agree` on its outcome: an
    exception in the block is this rank's failure, and every rank leaves with the same
    ``CheckpointError`` if any rank failed (a ``KeyboardInterrupt`` or ``SystemExit``
    passes through unagreed: the process is stopping)."""
    outcome: bool | BaseException = True
    try:
        yield
    except Exception as exc:
        outcome = exc
    agree(outcome, what, group)


def broadcast_from_rank0(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (identity without a process group)."""
    dist = _dist()
    if dist is None or dist.get_world_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def on_rank0(decide: Callable[[], T], what: str, group: Any = None) -> T:
    """Rank 0 runs ``decide``; every rank of ``group`` gets its value, or every rank raises the
    same ``CheckpointError`` naming ``what`` and rank 0's error.

    The one way to share a decision only rank 0 makes (what the disk holds, the next name):
    a bare broadcast would leave the other ranks waiting forever for a value that rank 0,
    having raised, never sends. Collective: every rank of ``group`` calls it.
    """
    value: T | None = None
    outcome: bool | BaseException = True
    if rank(group) == 0:
        try:
            value = decide()
        except Exception as exc:
            outcome = exc
    agree(outcome, what, group)
    return broadcast_from_rank0(value, group)
