"""Calls for one tenant are safe while other slots train: from another thread, saves and
loads of slots 2 and 3 leave the training of slots 0 and 1 exactly as without them."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO
from tests.slots.helpers import build, differences, train

pytestmark = pytest.mark.slow

STEPS = 4


def test_saves_and_loads_in_another_thread_do_not_disturb_training(tmp_path):
    busy, quiet = build(tmp_path / "busy"), build(tmp_path / "quiet")
    for trainer in (busy, quiet):
        for slot in (0, 1):
            trainer.create_slot(slot)
    busy.create_slot(2, seed=11)
    errors: list[BaseException] = []

    def tenant() -> None:
        try:
            for _ in range(3):
                busy.save_slot(2, "carol")
                busy.load_slot(3, "carol")
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=tenant)
    thread.start()
    train(busy, STEPS, [0, 1])
    thread.join()
    assert errors == []
    train(quiet, STEPS, [0, 1])
    for slot in (0, 1):
        assert differences(quiet.slot_state(slot), busy.slot_state(slot)) == []
    assert differences(busy.slot_state(2), busy.slot_state(3)) == []


def test_importing_the_adapters_does_not_import_the_slot_runtime():
    code = (
        "import sys, veoptim.lora\n"
        "assert 'veoptim.optim' not in sys.modules and 'veoptim.slots' not in sys.modules\n"
        "from veoptim.slots import SlotTrainer, MultiLoRAConfig\n"
        "print(SlotTrainer.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "veoptim.slots.trainer"
