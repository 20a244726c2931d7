"""The run dir as one run's own: its identity record (``run.json``: the run id that every
checkpoint and export of the run records, and how the run began) and its lock
(``run.lock``: one writer at a time). See docs/getting_started.md, "Runs and run dirs"."""

from veoptim.rundir.identity import (
    ORIGIN_FRESH,
    ORIGIN_RESUMED,
    ORIGIN_WARM_START,
    RUN_FILE,
    RunIdentity,
    RunSource,
    new_run_id,
    read_identity,
    write_identity,
)
from veoptim.rundir.lock import (
    LOCK_FILE,
    Holder,
    RunDirInUseError,
    RunDirLock,
    holder_of,
    locked_run_dir,
    owning_run_dir,
    run_dir_problem,
)

__all__ = [
    "LOCK_FILE",
    "ORIGIN_FRESH",
    "ORIGIN_RESUMED",
    "ORIGIN_WARM_START",
    "RUN_FILE",
    "Holder",
    "RunDirInUseError",
    "RunDirLock",
    "RunIdentity",
    "RunSource",
    "holder_of",
    "locked_run_dir",
    "owning_run_dir",
    "run_dir_problem",
    "new_run_id",
    "read_identity",
    "write_identity",
]
