"""Child process of the SIGKILL campaign (``test_crash.py``): save slot 0 as 'alice' (v1),
train one step, then SIGKILL itself at ``phase`` of the second save. Snapshots of the slot
at each save are written beside the run for the parent to compare with what it loads.
``slots.keep_last=1`` so the second save reaches retention (it prunes the first)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from tests.slots.helpers import build, train


def main(run_dir: Path, phase: str) -> None:
    trainer = build(run_dir, **{"slots.keep_last": 1})
    trainer.create_slot(0)
    train(trainer, 2, [0])
    trainer.save_slot(0, "alice")
    torch.save(trainer.slot_state(0), run_dir / "v1.pt")
    train(trainer, 1, [0], start=50)
    torch.save(trainer.slot_state(0), run_dir / "v2.pt")

    def crash(reached: str) -> None:
        if reached == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.store.fault_hook = crash
    trainer.save_slot(0, "alice")
    sys.exit(3)  # the phase was never reached


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
