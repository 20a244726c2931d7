"""``python -m tasks.serve`` whose slot store kills the server with SIGKILL the ``N``-th
time a save reaches ``PHASE``: ``VEOPTIM_TEST_KILL_AT=PHASE:N`` (a phase of
``veoptim.checkpoint.publish.PHASES``). The restart tests crash a save at an exact point
with it instead of a timed kill."""

from __future__ import annotations

import os
import signal

from tasks.serve import main
from veoptim.checkpoint.publish import PHASES
from veoptim.lora.slots.store import SlotStore

phase, _, count = os.environ["VEOPTIM_TEST_KILL_AT"].partition(":")
assert phase in PHASES and count.isdigit(), f"VEOPTIM_TEST_KILL_AT={phase}:{count}"
reached = [0]


def kill_at(name: str) -> None:
    if name == phase:
        reached[0] += 1
        if reached[0] == int(count):
            os.kill(os.getpid(), signal.SIGKILL)


_init = SlotStore.__init__


def _init_with_kill(self: SlotStore, *args: object, **kwargs: object) -> None:
    _init(self, *args, **kwargs)
    self.fault_hook = kill_at


SlotStore.__init__ = _init_with_kill  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
