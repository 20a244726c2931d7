"""``python -m tasks.serve`` whose slot store stops a save at an exact point:

- ``VEOPTIM_TEST_KILL_AT=PHASE:N``: the server kills itself with SIGKILL the ``N``-th time
  a save reaches ``PHASE`` (a phase of ``veoptim.checkpoint.publish.PHASES``); the restart
  tests crash a save at an exact point with it instead of a timed kill.
- ``VEOPTIM_TEST_PAUSE_AT=PHASE:N:FILE``: the ``N``-th save to reach ``PHASE`` writes
  ``FILE.reached`` and waits (at most 120 s) until ``FILE`` exists; the drain test holds the
  worker busy with it while requests queue behind the save.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tasks.serve import main
from veoptim.checkpoint.faults import PHASES
from veoptim.slots.store import SlotStore

WAIT_S = 120.0


def parse(variable: str) -> tuple[str, int, str]:
    phase, _, rest = os.environ.get(variable, "").partition(":")
    count, _, path = rest.partition(":")
    if phase:
        assert phase in PHASES and count.isdigit(), f"{variable}={os.environ[variable]}"
    return phase, int(count or 0), path


KILL, PAUSE = parse("VEOPTIM_TEST_KILL_AT"), parse("VEOPTIM_TEST_PAUSE_AT")
reached = {"kill": 0, "pause": 0}


def hook(name: str) -> None:
    if name == KILL[0]:
        reached["kill"] += 1
        if reached["kill"] == KILL[1]:
            os.kill(os.getpid(), signal.SIGKILL)
    if name == PAUSE[0]:
        reached["pause"] += 1
        if reached["pause"] == PAUSE[1]:
            release = Path(PAUSE[2])
            Path(f"{release}.reached").touch()
            deadline = time.monotonic() + WAIT_S
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.02)


_init = SlotStore.__init__


def _init_with_hook(self: SlotStore, *args: object, **kwargs: object) -> None:
    _init(self, *args, **kwargs)
    self.fault_hook = hook


SlotStore.__init__ = _init_with_hook  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
