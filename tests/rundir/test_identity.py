"""The run record ``run.json``: written atomically, read back exactly, refused when torn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from veoptim.errors import ConfigError
from veoptim.rundir import (
    ORIGIN_WARM_START,
    RUN_FILE,
    RunIdentity,
    RunSource,
    new_run_id,
    read_identity,
    write_identity,
)
from veoptim.rundir.identity import RUN_ID_PATTERN


def test_run_ids_are_unique_and_sortable_by_start() -> None:
    ids = {new_run_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(RUN_ID_PATTERN.fullmatch(i) for i in ids)


def test_a_record_reads_back_exactly_and_replaces_the_old_one(tmp_path: Path) -> None:
    assert read_identity(tmp_path) is None
    first = RunIdentity.fresh()
    write_identity(tmp_path, first)
    assert read_identity(tmp_path) == first
    warm = RunIdentity.fresh(ORIGIN_WARM_START, RunSource("/x/step_00000004", first.run_id, 4))
    write_identity(tmp_path, warm)
    assert read_identity(tmp_path) == warm
    assert sorted(p.name for p in tmp_path.iterdir()) == [RUN_FILE]  # no temporary left


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": "something else"}),
        json.dumps({"format": "veoptim.run", "format_version": 1, "run_id": "../x"}),
        json.dumps({"format": "veoptim.run", "format_version": 99}),
    ],
)
def test_a_damaged_record_is_refused_naming_the_file(tmp_path: Path, content: str) -> None:
    (tmp_path / RUN_FILE).write_text(content)
    with pytest.raises(ConfigError, match=RUN_FILE):
        read_identity(tmp_path)
