"""The named DeviceMesh of a run and the sub-meshes each parallelism uses.

The world mesh is ``(dp_replicate, efsdp, ep)`` in rank order, outermost first,
so the ep groups are runs of consecutive ranks (the all-to-all stays inside a
node when ``ep`` divides the ranks per node). Dense parameters are sharded over
``dp_shard = efsdp x ep`` (the view ``(dp_replicate, dp_shard)`` of the same
ranks); expert parameters are split over ``ep`` and sharded over ``efsdp``.
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

    world: DeviceMesh  # (dp_replicate, efsdp, ep)
    dense_fsdp: DeviceMesh  # (dp_shard,) or HSDP (dp_replicate, dp_shard)
    expert_fsdp: DeviceMesh  # (efsdp,) or HSDP (dp_replicate, efsdp)
    ep: DeviceMesh  # (ep,)
    dp: DeviceMesh  # (dp,): every rank; used for all-reduces of counts and losses


def build_meshes(device_type: str, sizes: ParallelSizes) -> ParallelMeshes:
    """Create the meshes (collective on all ranks).

    Both views are unflattened from one 1D world mesh, as torchtitan does, so
    they share a root and FSDP2 can combine the expert FSDP mesh with the ep mesh.
    """
    dp = init_device_mesh(device_type, (sizes.world,), mesh_dim_names=(DIM_DP,))
    dense = dp._unflatten(0, (sizes.dp_replicate, sizes.dp_shard), (DIM_DP_REPLICATE, DIM_DP_SHARD))
    world = dp._unflatten(0, (sizes.dp_replicate, sizes.efsdp, sizes.ep), MESH_DIM_NAMES)
    hsdp = sizes.dp_replicate > 1
    return ParallelMeshes(
        world=world,
        dense_fsdp=dense if hsdp else dense[DIM_DP_SHARD],
        expert_fsdp=world[(DIM_DP_REPLICATE, DIM_EFSDP)] if hsdp else world[DIM_EFSDP],
        ep=world[DIM_EP],
        dp=dp,
    )
