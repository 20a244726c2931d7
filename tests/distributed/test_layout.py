"""Layout metadata: JSON round trip, fail-closed parsing, optimizer compatibility."""

from __future__ import annotations

import dataclasses
import json

import pytest

from veoptim.distributed import LAYOUT_FORMAT_VERSION, LayoutMetadata
from veoptim.distributed.layout import contiguous_expert_placement
from veoptim.errors import CheckpointError


def layout(world: int = 4, replicate: int = 1, ep: int = 2, experts: int = 4) -> LayoutMetadata:
    return LayoutMetadata(
        mesh_dim_names=("dp_replicate", "efsdp", "ep"),
        mesh_dim_sizes=(replicate, world // replicate // ep, ep),
        world_size=world,
        ep_size=ep,
        num_experts=experts,
        expert_placement=contiguous_expert_placement(experts, ep),
    )


def test_json_round_trip_is_exact():
    original = layout()
    assert LayoutMetadata.from_json(json.loads(json.dumps(original.to_json()))) == original


def test_json_records_the_format_version():
    assert layout().to_json()["format_version"] == LAYOUT_FORMAT_VERSION


def test_layout_metadata_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout().ep_size = 4  # type: ignore[misc]


def test_unknown_format_version_fails_closed():
    data = {**layout().to_json(), "format_version": LAYOUT_FORMAT_VERSION + 1}
    with pytest.raises(CheckpointError, match="format_version 2 is not supported"):
        LayoutMetadata.from_json(data)


def test_missing_key_fails_closed():
    data = layout().to_json()
    del data["expert_placement"]
    with pytest.raises(CheckpointError, match=r"missing keys \['expert_placement'\]"):
        LayoutMetadata.from_json(data)


def test_wrong_value_type_fails_closed():
    with pytest.raises(CheckpointError, match="wrong type"):
        LayoutMetadata.from_json({**layout().to_json(), "ep_size": "two"})


def test_expert_placement_is_contiguous_blocks():
    assert contiguous_expert_placement(8, 4) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert contiguous_expert_placement(0, 1) == ()


def test_optimizer_state_reshards_across_dense_world_sizes():
    assert layout(world=4, ep=2).optimizer_compatible(layout(world=8, replicate=2, ep=2)) is None


def test_optimizer_state_across_different_ep_sizes_is_rejected_with_reason():
    reason = layout(ep=2).optimizer_compatible(layout(ep=4))
    assert reason == "expert-parallel size differs (saved ep=2, live ep=4)"


def test_optimizer_state_across_different_expert_counts_is_rejected():
    assert "number of experts differs" in layout(experts=4).optimizer_compatible(layout(experts=8))


def test_optimizer_state_across_a_different_expert_placement_is_rejected():
    shuffled = dataclasses.replace(layout(), expert_placement=((2, 3), (0, 1)))
    assert "expert placement differs" in layout().optimizer_compatible(shuffled)


def test_differences_lists_every_changed_field():
    diffs = layout(world=4).differences(layout(world=8, replicate=2))
    assert diffs == ["mesh_dim_sizes: [1, 2, 2] -> [2, 2, 2]", "world_size: 4 -> 8"]
