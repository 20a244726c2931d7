"""The named DeviceMesh of a run and the sub-meshes each parallelism uses.

One 3D mesh ``(dp_replicate, efsdp, ep)`` in rank order, outermost first, so
the ep groups are runs of consecutive ranks (the all-to-all stays inside a node
when ``ep`` divides the ranks per node). ``dp_shard`` is ``efsdp x ep``
flattened: dense parameters are sharded over it, expert parameters over
``efsdp`` only (and split over ``ep``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from veoptim.distributed.layout import MESH_DIM_NAMES
from veoptim.distributed.sizes import ParallelSizes

DIM_DP_REPLICATE, DIM_EFSDP, DIM_EP = MESH_DIM_NAMES
DIM_DP_SHARD = "dp_shard"  # flattened (efsdp, ep)
DIM_DP = "dp"  # flattened (dp_replicate, efsdp, ep): the whole data-parallel world


@dataclass(frozen=True)
class ParallelMeshes:
    """The world mesh and its named views."""

    world: DeviceMesh
    dense_fsdp: DeviceMesh  # (dp_shard,) or HSDP (dp_replicate, dp_shard)
    expert_fsdp: DeviceMesh  # (efsdp,) or HSDP (dp_replicate, efsdp)
    ep: DeviceMesh  # (ep,)
    dp: DeviceMesh  # (dp,): every rank; used for all-reduces of counts and losses


def build_meshes(device_type: str, sizes: ParallelSizes) -> ParallelMeshes:
    """Create the world mesh and flatten the data-parallel views (collective on all ranks)."""
    shape = (sizes.dp_replicate, sizes.efsdp, sizes.ep)
    world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
    world[(DIM_EFSDP, DIM_EP)]._flatten(DIM_DP_SHARD)
    world[MESH_DIM_NAMES]._flatten(DIM_DP)
    hsdp = sizes.dp_replicate > 1
    dense = world[(DIM_DP_REPLICATE, DIM_DP_SHARD)] if hsdp else world[DIM_DP_SHARD]
    expert = world[(DIM_DP_REPLICATE, DIM_EFSDP)] if hsdp else world[DIM_EFSDP]
    return ParallelMeshes(world=world, dense_fsdp=dense, expert_fsdp=expert, ep=world[DIM_EP], dp=world[DIM_DP])
