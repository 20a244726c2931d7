"""SIGKILL at every phase of a save (real subprocesses), one campaign for the store's two
kinds of writer: a plain publication (files written into a version, also killed inside a
shard) and a slot save through the checkpointer (a real ``SlotTrainer`` in a process forked
from the preloaded server of ``tests/forkserver.py``; every phase of
the one vocabulary in ``publish.py``: the checkpointer's gather, writer and write, then the
store's). The name always resolves to a complete old or new version, a reader loads it
(the slot: bitwise the state saved), and the next save succeeds and cleans up."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import forkserver
from tests.checkpoint.helpers.payload import check_payload, write_payload
from tests.conftest import REPO
from tests.slots.helpers import build, differences
from veoptim.checkpoint import layout
from veoptim.checkpoint.faults import PHASE_AFTER_REPLACE, PHASES, SAVE_PHASES
from veoptim.checkpoint.layout import published_names
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import latest_complete, resolve
from veoptim.errors import CheckpointError
from veoptim.slots.store import SlotStore

pytestmark = pytest.mark.slow

HELPERS = Path(__file__).parent / "helpers"
WRITER = HELPERS / "crash_writer.py"
SLOT_CHILD = "tests.checkpoint.helpers.slot_crash_child"
MID_SHARD = "mid_shard"
REPEATS = 3
#: (writer, phase): the plain publication at each of the store's phases and inside a
#: shard; the slot save at each phase a checkpointer's save reaches.
CAMPAIGN = [("version", phase) for phase in (MID_SHARD, *PHASES)] + [
    ("slot", phase) for phase in SAVE_PHASES
]
#: Phases at which the name must show the new version: from the replace on.
NEW_VISIBLE = set(SAVE_PHASES[SAVE_PHASES.index(PHASE_AFTER_REPLACE) :])


def run_writer(root: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(WRITER), str(root), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def debris(root: Path) -> list[str]:
    """Temporary links and versions that no name points to."""
    referenced = set(published_names(root).values())
    temp = [e for e in os.listdir(root) if layout.is_temp_link_name(e)]
    stray = [v for v in os.listdir(root / layout.VERSIONS_DIR) if v not in referenced]
    return temp + stray


def assert_every_name_complete(root: Path) -> dict[str, int]:
    """Each published name resolves to a complete version whose files hold one step."""
    return {name: check_payload(resolve(root, name)) for name in published_names(root)}


@pytest.fixture(scope="module")
def slot_reader(tmp_path_factory):
    return build(tmp_path_factory.mktemp("reader"))


@pytest.mark.parametrize(("writer", "phase"), CAMPAIGN)
def test_sigkill_at_phase_leaves_old_or_new_complete_and_next_save_succeeds(
    tmp_path: Path, writer: str, phase: str, request
) -> None:
    if writer == "version":
        sigkill_a_publication(tmp_path, phase)
    else:
        sigkill_a_slot_save(tmp_path, phase, request.getfixturevalue("slot_reader"))


def sigkill_a_publication(tmp_path: Path, phase: str) -> None:
    root = tmp_path / "ckpts"
    pub = Publisher(root, fsync=False)
    step = 1
    with pub.write("ckpt", step=step) as version:
        write_payload(version, step, 64)
    for _ in range(REPEATS):
        with pub.write("old", step=0) as version:  # something for retention to prune
            write_payload(version, 0, 64)
        killed = run_writer(
            root,
            "--step",
            str(step + 1),
            "--die-at",
            phase,
            "--keep-last",
            "1",
            "--shard-bytes",
            "20000",
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        seen = check_payload(resolve(root, "ckpt"))  # a reader loads it
        assert seen == (step + 1 if phase in NEW_VISIBLE else step)
        assert_every_name_complete(root)
        step += 1
        done = run_writer(root, "--step", str(step + 1), "--keep-last", "1")
        assert done.returncode == 0, done.stderr
        step += 1
        assert check_payload(resolve(root, "ckpt")) == step
        assert sorted(published_names(root)) == ["ckpt"]  # keep_last=1 pruned "old"
        # Only the version superseded by this save may remain besides the published one.
        assert len(debris(root)) <= 1 and not [d for d in debris(root) if d.startswith(".")]


def sigkill_a_slot_save(tmp_path: Path, phase: str, reader) -> None:
    """The child saves slot 0 as 'alice' (v1), trains a step, and dies at ``phase`` of the
    second save; the slot loads bitwise the save the name shows, and saves again."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = forkserver.run_module(SLOT_CHILD, [str(tmp_path), phase], cwd=REPO, env=env,
                                 timeout=120)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    expected = torch.load(tmp_path / ("v2.pt" if phase in NEW_VISIBLE else "v1.pt"))
    reader.store = SlotStore(tmp_path / "checkpoints" / "slots")
    reader.load_slot(0, "alice")
    assert differences(expected, reader.slot_state(0)) == []
    reader.save_slot(0, "alice")  # the next save succeeds over the debris
    reader.load_slot(1, "alice")
    assert differences(expected, reader.slot_state(1)) == []


def test_negative_control_non_atomic_publish_loses_the_name(tmp_path: Path) -> None:
    """The checks above do catch a publish that is not atomic (rename aside, rename in)."""
    legacy = tmp_path / "ckpt"
    legacy.mkdir()
    write_payload(legacy, 1, 64)
    killed = run_writer(tmp_path, "--naive", "--step", "2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with pytest.raises(CheckpointError, match="No checkpoint named 'ckpt'"):
        resolve(tmp_path, "ckpt")


def test_sigkill_at_random_instants_during_repeated_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    rng = random.Random(1234)
    highest = 0
    for _ in range(12):
        proc = subprocess.Popen(
            [
                sys.executable,
                str(WRITER),
                str(root),
                "--loop",
                "--keep-last",
                "2",
                "--shard-bytes",
                "100000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(rng.uniform(0.15, 0.5))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
        if not root.exists():
            continue
        steps = assert_every_name_complete(root)
        name = latest_complete(root)
        if name is None:
            continue
        newest = check_payload(resolve(root, name))
        assert newest >= highest and newest == max(steps.values())
        highest = newest
    assert highest > 0, "the writer never published; kill timings were too short"
    done = run_writer(root, "--name", "final", "--step", str(highest + 1), "--keep-last", "2")
    assert done.returncode == 0, done.stderr
    assert check_payload(resolve(root, latest_complete(root))) == highest + 1
    assert not [d for d in debris(root) if d.startswith(".")]
