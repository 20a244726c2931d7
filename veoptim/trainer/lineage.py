"""Which run a training process continues or starts, decided once per start.

The run dir's record (``run.json``, ``veoptim.rundir``) names its run. ``checkpoint.resume=auto``
looks only at checkpoints that run published; a named checkpoint (a name or a path) is
loaded whoever wrote it, and the log says when it is another run's. After the load:

* a full resume continues the run that wrote the checkpoint (its run id);
* a fresh start creates a new run id, except ``auto`` finding no checkpoint of the run dir's
  run yet: that run (which never saved) starts again under its own id;
* a weights-only load, or a checkpoint written before run ids, starts a new run id that
  records where it started (``source``).

The dry run describes the same decision (:func:`describe_start`) from the same resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

from veoptim.checkpoint import Resolved
from veoptim.rundir import (
    ORIGIN_RESUMED,
    ORIGIN_WARM_START,
    RunIdentity,
    RunSource,
)


def auto_run(current: RunIdentity | None) -> str | None:
    """The run whose checkpoints ``auto`` considers (None: no record, any run's)."""
    return current.run_id if current is not None else None


@dataclass(frozen=True)
class RunStart:
    """The identity this process trains under, and what the log says about it."""

    identity: RunIdentity
    notes: tuple[str, ...] = ()


def _source(resolved: Resolved) -> RunSource:
    return RunSource(str(resolved.path), resolved.run, resolved.step or 0)


def _whose(resolved: Resolved, current: RunIdentity | None) -> str:
    """How the log names the run of a loaded checkpoint, relative to the run dir's."""
    if resolved.run is None:
        return "a checkpoint that records no run id (written before veoptim kept run ids)"
    if current is None:
        return f"run {resolved.run}'s checkpoint (this run dir had no run yet)"
    if current.run_id == resolved.run:
        return f"this run's own checkpoint (run {resolved.run})"
    return f"another run's checkpoint: run {resolved.run}, not this run dir's run {current.run_id}"


def start_run(
    current: RunIdentity | None, ref: str, resolved: Resolved | None, *, full: bool
) -> RunStart:
    """The run this process trains under, after loading ``resolved`` (None: nothing
    loaded) for ``checkpoint.resume=ref`` with the whole state (``full``) or weights only."""
    if resolved is None:
        if ref == "auto" and current is not None:
            return RunStart(current, (f"run {current.run_id} has no checkpoint yet: it starts "
                                      "again from step 0",))  # fmt: skip
        fresh = RunIdentity.fresh()
        return RunStart(fresh, (f"new run {fresh.run_id}",))
    where = f"{resolved.name} (step {resolved.step}, {resolved.path})"
    if not full:
        warm = RunIdentity.fresh(ORIGIN_WARM_START, _source(resolved))
        return RunStart(warm, (f"warm start of new run {warm.run_id} from the weights of "
                               f"{where}, {_whose(resolved, current)}",))  # fmt: skip
    if resolved.run is None:
        adopted = RunIdentity.fresh(ORIGIN_RESUMED, _source(resolved))
        return RunStart(adopted, (f"resumed {where}, {_whose(resolved, current)}; it "
                                  f"continues as run {adopted.run_id}",))  # fmt: skip
    if current is not None and current.run_id == resolved.run:
        return RunStart(current, (f"resumed {where}, {_whose(resolved, current)}",))
    base = current or RunIdentity.fresh()
    continued = base.continued_as(resolved.run, _source(resolved))
    return RunStart(continued, (f"resumed {where}, {_whose(resolved, current)}; this run dir "
                                f"now continues run {resolved.run}",))  # fmt: skip


def describe_start(
    current: RunIdentity | None, ref: str, resolved: Resolved | None, *, full: bool
) -> str:
    """What the dry run prints for the checkpoint a real start would load (the same
    resolution and the same rules as :func:`start_run`)."""
    if resolved is not None:
        what = "resumes from" if full else "loads the weights of"
        where = f"{resolved.name} (step {resolved.step}, {resolved.path})"
        return f"{what} {where}, {_whose(resolved, current)}"
    if ref == "auto" and current is not None:
        return (
            f"checkpoint.resume=auto: run {current.run_id} has no checkpoint yet, it starts "
            "again from step 0 (other runs' checkpoints here are ignored)"
        )
    if ref == "auto":
        return "checkpoint.resume=auto: none yet, starts fresh"
    return "starts a new run"
