"""Local-shard access for plain tensors and FSDP2 DTensors.

The optimizers compute on local shards only; state tensors of a DTensor
parameter are DTensors with the parameter's mesh and placements (so DCP saves
them sharded), built without moving their local tensor to the mesh device
(offloaded state stays in host memory).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no copy), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def wrap_like(param: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """Wrap ``local_tensor`` as a state tensor of ``param``: a DTensor with its layout, or as is."""
    if not isinstance(param, DTensor):
        return local_tensor
    spec = DTensorSpec(
        param._spec.mesh,
        param._spec.placements,
        tensor_meta=TensorMeta(param.shape, param.stride(), local_tensor.dtype),
    )
    return DTensor(local_tensor, spec, requires_grad=False)


def global_flat_offset(param: torch.Tensor) -> int:
    """Flat index of this rank's first local element in the global tensor (0 for plain tensors).

    Exact for FSDP2's dim-0 sharding; used only to decorrelate stochastic-rounding
    noise between shards, never for arithmetic.
    """
    if not isinstance(param, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    strides = param.stride()
    return int(sum(o * s for o, s in zip(offset, strides, strict=True)))
