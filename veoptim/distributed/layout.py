"""Layout metadata: the parallel layout a checkpoint was written under.

Checkpoints record it, so a resume can tell what may be resharded. Model weights are saved as DTensors with their
global shapes, so DCP reshards them to any layout; optimizer state is only
accepted under the same expert-parallel layout, and
:meth:`LayoutMetadata.optimizer_compatible` says why not otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from veoptim.errors import CheckpointError

LAYOUT_FORMAT_VERSION = 1
# The mesh of every run, outermost first (the ``dp_shard`` dim is efsdp x ep flattened).
MESH_DIM_NAMES = ("dp_replicate", "efsdp", "ep")
KEY_FORMAT_VERSION = "format_version"
KEY_MESH_DIM_NAMES = "mesh_dim_names"
KEY_MESH_DIM_SIZES = "mesh_dim_sizes"
KEY_WORLD_SIZE = "world_size"
KEY_EP_SIZE = "ep_size"
KEY_NUM_EXPERTS = "num_experts"
KEY_EXPERT_PLACEMENT = "expert_placement"
KEYS = (
    KEY_FORMAT_VERSION,
    KEY_MESH_DIM_NAMES,
    KEY_MESH_DIM_SIZES,
    KEY_WORLD_SIZE,
    KEY_EP_SIZE,
    KEY_NUM_EXPERTS,
    KEY_EXPERT_PLACEMENT,
)


def contiguous_expert_placement(num_experts: int, ep: int) -> tuple[tuple[int, ...], ...]:
    """Global expert ids owned by each ep rank: rank ``j`` owns block ``j`` of ``num_experts / ep``."""
    if num_experts == 0:
        return ()
    per_rank = num_experts // ep
    return tuple(tuple(range(j * per_rank, (j + 1) * per_rank)) for j in range(ep))


@dataclass(frozen=True)
class LayoutMetadata:
    """Mesh dims and sizes, EP size and expert placement of a run (a JSON-able value object)."""

    mesh_dim_names: tuple[str, ...]
    mesh_dim_sizes: tuple[int, ...]
    world_size: int
    ep_size: int
    num_experts: int
    expert_placement: tuple[tuple[int, ...], ...]
    format_version: int = LAYOUT_FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            KEY_FORMAT_VERSION: self.format_version,
            KEY_MESH_DIM_NAMES: list(self.mesh_dim_names),
            KEY_MESH_DIM_SIZES: list(self.mesh_dim_sizes),
            KEY_WORLD_SIZE: self.world_size,
            KEY_EP_SIZE: self.ep_size,
            KEY_NUM_EXPERTS: self.num_experts,
            KEY_EXPERT_PLACEMENT: [list(ids) for ids in self.expert_placement],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayoutMetadata:
        """Parse recorded metadata; unknown versions and malformed records fail closed."""
        if not isinstance(data, dict):
            raise CheckpointError(
                f"layout metadata must be a JSON object, found {type(data).__name__}."
            )
        version = data.get(KEY_FORMAT_VERSION)
        if version != LAYOUT_FORMAT_VERSION:
            raise CheckpointError(
                f"layout metadata format_version {version!r} is not supported (expected {LAYOUT_FORMAT_VERSION}); "
                "this checkpoint was written by a different veoptim version."
            )
        missing = [k for k in KEYS if k not in data]
        unknown = sorted(set(data) - set(KEYS))
        if missing or unknown:
            raise CheckpointError(
                f"layout metadata is malformed: missing keys {missing}, unknown keys {unknown}."
            )
        try:
            layout = cls(
                mesh_dim_names=tuple(str(n) for n in data[KEY_MESH_DIM_NAMES]),
                mesh_dim_sizes=tuple(int(s) for s in data[KEY_MESH_DIM_SIZES]),
                world_size=int(data[KEY_WORLD_SIZE]),
                ep_size=int(data[KEY_EP_SIZE]),
                num_experts=int(data[KEY_NUM_EXPERTS]),
                expert_placement=tuple(
                    tuple(int(e) for e in ids) for ids in data[KEY_EXPERT_PLACEMENT]
                ),
                format_version=int(version),
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"layout metadata has a value of the wrong type: {exc}.") from exc
        if len(layout.mesh_dim_names) != len(layout.mesh_dim_sizes):
            raise CheckpointError(
                f"layout metadata names {len(layout.mesh_dim_names)} mesh dims but gives "
                f"{len(layout.mesh_dim_sizes)} sizes."
            )
        return layout

    def differences(self, other: LayoutMetadata) -> list[str]:
        """Every field that differs, as 'field: self -> other' lines (for logs)."""
        mine, theirs = self.to_json(), other.to_json()
        return [f"{k}: {mine[k]} -> {theirs[k]}" for k in KEYS if mine[k] != theirs[k]]

    def optimizer_compatible(self, other: LayoutMetadata) -> str | None:
        """Why optimizer state saved under ``self`` cannot be loaded under ``other``, or None.

        Dense FSDP resharding (another world size or dp split) is allowed; a
        different expert-parallel layout (EP size, number of experts or which
        experts each ep rank owns) is not.
        """
        if self.format_version != other.format_version:
            return f"layout format version differs (saved {self.format_version}, live {other.format_version})"
        if self.num_experts != other.num_experts:
            return f"number of experts differs (saved {self.num_experts}, live {other.num_experts})"
        if self.ep_size != other.ep_size:
            return (
                f"expert-parallel size differs (saved ep={self.ep_size}, live ep={other.ep_size})"
            )
        if self.expert_placement != other.expert_placement:
            return (
                f"expert placement differs (saved {[list(p) for p in self.expert_placement]}, "
                f"live {[list(p) for p in other.expert_placement]})"
            )
        return None
