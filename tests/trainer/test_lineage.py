"""Which run a start continues or creates (``veoptim/trainer/lineage.py``), rule by rule."""

from __future__ import annotations

from pathlib import Path

from veoptim.checkpoint import Resolved
from veoptim.rundir import ORIGIN_FRESH, ORIGIN_RESUMED, ORIGIN_WARM_START, RunIdentity
from veoptim.trainer.lineage import auto_run, describe_start, start_run

HERE = RunIdentity.fresh()
OTHER = RunIdentity.fresh()
OWN = Resolved(
    "step_00000010", Path("/r/checkpoints/.versions/step_00000010.aaaa"), HERE.run_id, 10
)
FOREIGN = Resolved(
    "/o/checkpoints/step_00000040",
    Path("/o/checkpoints/.versions/step_00000040.bbbb"),
    OTHER.run_id,
    40,
)
LEGACY = Resolved("step_00000005", Path("/l/checkpoints/step_00000005"), None, 5)


def test_auto_considers_the_run_dirs_run_or_any_run_without_a_record() -> None:
    assert auto_run(HERE) == HERE.run_id
    assert auto_run(None) is None


def test_a_fresh_start_creates_a_new_run() -> None:
    for current in (None, HERE):
        start = start_run(current, "", None, full=True)
        assert start.identity.origin == ORIGIN_FRESH
        assert start.identity.run_id not in (HERE.run_id, OTHER.run_id)


def test_auto_without_a_checkpoint_of_the_run_restarts_that_run() -> None:
    start = start_run(HERE, "auto", None, full=True)
    assert start.identity == HERE
    assert "no checkpoint yet" in start.notes[0]


def test_a_full_resume_of_the_runs_own_checkpoint_continues_it() -> None:
    start = start_run(HERE, "auto", OWN, full=True)
    assert start.identity == HERE and "own checkpoint" in start.notes[0]


def test_a_full_resume_of_another_runs_checkpoint_continues_that_run_and_says_so() -> None:
    start = start_run(HERE, "/o/checkpoints/step_00000040", FOREIGN, full=True)
    assert start.identity.run_id == OTHER.run_id
    assert start.identity.origin == ORIGIN_RESUMED
    assert start.identity.source.checkpoint == str(FOREIGN.path)
    note = start.notes[0]
    assert "another run's checkpoint" in note and OTHER.run_id in note and HERE.run_id in note


def test_weights_only_starts_a_new_run_that_records_its_source() -> None:
    start = start_run(HERE, "step_00000010", OWN, full=False)
    assert start.identity.origin == ORIGIN_WARM_START
    assert start.identity.run_id != HERE.run_id
    assert start.identity.source.run_id == HERE.run_id and start.identity.source.step == 10
    assert "warm start" in start.notes[0]


def test_a_checkpoint_without_a_run_id_continues_as_a_new_run() -> None:
    start = start_run(None, "step_00000005", LEGACY, full=True)
    assert start.identity.origin == ORIGIN_RESUMED and start.identity.source.run_id is None
    assert "records no run id" in start.notes[0]


def test_the_dry_run_describes_each_case_as_the_start_decides_it() -> None:
    assert "this run's own checkpoint" in describe_start(HERE, "auto", OWN, full=True)
    assert "another run's" in describe_start(HERE, "x", FOREIGN, full=True)
    assert "loads the weights of" in describe_start(HERE, "x", OWN, full=False)
    assert "no checkpoint yet" in describe_start(HERE, "auto", None, full=True)
    assert "none yet" in describe_start(None, "auto", None, full=True)
