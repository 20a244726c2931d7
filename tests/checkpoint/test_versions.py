"""The path contract: names, version ids and link targets (veoptim/checkpoint/layout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from veoptim.checkpoint import layout
from veoptim.errors import CheckpointError

GOOD_NAMES = ["step_00000100", "best", "hf_final", "run-3.lora", "A1", "x" * layout.NAME_MAX_LEN]
BAD_NAMES = [
    "",
    "..",
    ".",
    "../escape",
    "a/../../b",
    "a/b",
    "/abs/path",
    ".versions",
    ".tmp-link.x",
    ".hidden",
    "a..b",
    "trailing.",
    "back\\slash",
    "new\nline",
    "sp ace",
    "x" * (layout.NAME_MAX_LEN + 1),
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_valid_names_are_accepted(name: str) -> None:
    assert layout.validate_name(name) == name


@pytest.mark.parametrize("name", BAD_NAMES)
def test_escaping_or_reserved_names_are_rejected(name: str) -> None:
    with pytest.raises(CheckpointError, match="not allowed|non-empty"):
        layout.validate_name(name)


def test_non_string_name_is_rejected() -> None:
    with pytest.raises(CheckpointError):
        layout.validate_name(None)  # type: ignore[arg-type]


def test_step_name_is_zero_padded_and_sorts_by_step() -> None:
    assert layout.step_name(100) == "step_00000100"
    assert sorted([layout.step_name(s) for s in (20, 3, 100)]) == [
        layout.step_name(s) for s in (3, 20, 100)
    ]


def test_new_version_ids_are_unique_and_round_trip_through_link_targets() -> None:
    ids = {layout.new_version_id("step_00000001") for _ in range(100)}
    assert len(ids) == 100
    for version_id in ids:
        assert version_id.startswith("step_00000001.")
        target = layout.link_target(version_id)
        assert target == f"{layout.VERSIONS_DIR}/{version_id}"
        assert not Path(target).is_absolute()
        assert layout.parse_link_target(target) == version_id


@pytest.mark.parametrize(
    "target",
    [
        "/abs/.versions/a.0123456789abcdef",
        "../outside",
        ".versions/../../etc",
        ".versions/a.0123456789abcdef/../../x",
        ".versions/not-a-version",
        "other_name",
        ".versions/.versions/a.0123456789abcdef",
    ],
)
def test_link_targets_other_than_one_version_are_not_parsed(target: str) -> None:
    assert layout.parse_link_target(target) is None


def test_version_dir_rejects_ids_that_are_not_version_ids(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="version id"):
        layout.version_dir(tmp_path, "../../etc")


def test_temp_links_are_hidden_and_recognised(tmp_path: Path) -> None:
    tmp = layout.temp_link_path(tmp_path, "step_1", "abc")
    assert tmp.parent == tmp_path and tmp.name.startswith(".")
    assert layout.is_temp_link_name(tmp.name)
    assert not layout.is_temp_link_name("step_1")
