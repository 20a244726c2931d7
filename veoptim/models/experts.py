"""Mixture-of-experts layers under expert parallelism.

transformers 5.x stores the experts of a MoE block as fused 3D parameters
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) in one module
called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:class:`ExpertParallelExperts` replaces that module with one that holds only this
rank's experts (as a DTensor ``Shard(0)`` over the ep mesh, so state-dict keys
and global shapes stay those of the original model) and computes them on the
tokens a dispatcher brings in, all local experts at once with grouped matrix
multiplications where torch has a kernel for them that keeps the group ends on the
device (else one matmul pair per expert). This module knows the model side; the communication is behind the
:class:`Dispatcher` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class RowGroups:
    """How dispatched rows (sorted by local expert) split over the local experts."""

    counts: list[int]  # rows per local expert, on the host (the dispatcher already read them)
    offsets: torch.Tensor  # int32 end of each expert's rows, on the rows' device


class Dispatcher(Protocol):
    """Moves (token, expert) pairs to the rank that owns the expert and back."""

    num_experts: int
    num_local: int
    local_expert_ids: range

    def dispatch(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, RowGroups, Any]:
        """Rows sorted by local expert, how they split over the local experts, and what
        :meth:`combine` needs."""
        ...

    def combine(self, expert_out: torch.Tensor, state: Any) -> torch.Tensor: ...


def is_fused_experts(module: nn.Module) -> bool:
    """True for a transformers fused-experts module (3D ``gate_up_proj`` and ``down_proj``)."""
    params = [getattr(module, name, None) for name in FUSED_EXPERT_PARAMS]
    return all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params) and hasattr(
        module, "act_fn"
    )


def find_fused_experts(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every fused-experts module as ``(parent, attribute name, module)``, in model order."""
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if is_fused_experts(child):
                found.append((parent, attr, child))
    return found


def grouped_mm_applies(tokens: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes these experts, with its group ends kept on the device.

    Layout: it wants every row of its operands to be a multiple of 16 bytes (hidden and
    expert intermediate sizes; ``down`` is ``[E, H, I]``). Device: on CPU its kernel
    loops over the groups, reading offsets already in host memory; on CUDA the fused
    (CUTLASS) kernel takes BF16 on SM90/SM100, elsewhere torch falls back to a loop that
    copies the offsets to the host at every call (one sync per matmul, backward too);
    other devices (NPU) may have no kernel at all.
    """
    per_row = 16 // tokens.element_size()
    if any(size % per_row for size in down.shape[-2:]):
        return False
    if tokens.device.type == "cpu":
        return True
    if tokens.device.type == "cuda" and tokens.dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(tokens.device)[0] in (9, 10)
    return False


def _dense_grad(grad: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``'s backward rejects zero-stride (expanded) gradients, e.g. of ``.sum()``."""
    return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)


def experts_forward(
    tokens: torch.Tensor,
    groups: RowGroups,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    grouped: bool | None = None,
) -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert; no host synchronisation on either path.

    ``grouped`` (None: :func:`grouped_mm_applies`): two grouped matmuls
    for all experts, the group ends read on the device. Otherwise one ``F.linear`` pair
    per expert on its slice (``groups.counts``, already on the host) — the path for
    devices without a sync-free grouped kernel, and the reference the grouped path is
    tested against: on CPU both are bitwise equal, FP32 and BF16
    (``tests/models/test_grouped_experts.py``). Either way every expert weight
    takes part whole, so an expert (or a rank) with no rows still gets a zero gradient
    on every rank and FSDP's gradient reduce-scatter sees the same tensors everywhere.
    """
    if grouped is None:
        grouped = grouped_mm_applies(tokens, down)
    if not grouped:
        outs = []
        for e, chunk in enumerate(torch.split(tokens, groups.counts)):
            gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(act_fn(gate) * up, down[e]))
        return torch.cat(outs)
    ends = groups.offsets
    gate, up = F.grouped_mm(tokens, gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
    out = F.grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), offs=ends)
    if out.requires_grad:
        out.register_hook(_dense_grad)
    return out


def _split(full: nn.Parameter, ids: range, ep_mesh: DeviceMesh) -> nn.Parameter:
    """This rank's experts of ``full`` (indexed by expert first), as a DTensor ``Shard(0)``
    over ``ep`` with the global shape, so state-dict keys and shapes stay the model's."""
    local = full.detach()[ids.start : ids.stop].clone()
    dtensor = DTensor.from_local(
        local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )
    return nn.Parameter(dtensor, requires_grad=full.requires_grad)


class ExpertParallelExperts(nn.Module):
    """Drop-in for a fused-experts module that holds and computes only this rank's experts."""

    def __init__(self, experts: nn.Module, dispatcher: Dispatcher, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        num_experts = experts.gate_up_proj.shape[0]
        if num_experts != dispatcher.num_experts:
            raise ValueError(
                f"experts module has {num_experts} experts, the dispatcher {dispatcher.num_experts}."
            )
        self.num_experts = num_experts
        self.act_fn = experts.act_fn
        self.dispatcher = dispatcher
        #: ``(name, local weight, local expert ids) -> weight used``, applied after FSDP has
        #: gathered the weights (LoRA adds its per-expert updates here); None = as stored.
        self.weight_transform: Callable[[str, torch.Tensor, range], torch.Tensor] | None = None
        #: :func:`experts_forward`'s ``grouped``: None = by device; False = per-expert loop.
        self.grouped: bool | None = None
        ids = dispatcher.local_expert_ids
        for name in FUSED_EXPERT_PARAMS:
            self.register_parameter(name, _split(getattr(experts, name), ids, ep_mesh))
        # Children indexed by expert first (LoRA's per-expert adapters) go with their experts.
        for child_name, child in experts.named_children():
            for module in child.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    if param.dim() == 0 or param.shape[0] != num_experts:
                        raise ValueError(
                            f"{child_name} of the experts module holds {name} of shape "
                            f"{tuple(param.shape)}, not indexed by expert first."
                        )
                    setattr(module, name, _split(param, ids, ep_mesh))
            self.add_module(child_name, child)

    @staticmethod
    def _local(param: torch.Tensor) -> torch.Tensor:
        return param.to_local() if isinstance(param, DTensor) else param

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        rows, groups, state = self.dispatcher.dispatch(hidden_states, top_k_index)
        gate_up, down = (self._weight(name) for name in FUSED_EXPERT_PARAMS)
        out = experts_forward(rows, groups, gate_up, down, self.act_fn, self.grouped)
        pairs = self.dispatcher.combine(out, state).view(num_tokens, top_k, -1)
        weighted = pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)
        return weighted.sum(dim=1).to(hidden_states.dtype)

    def _weight(self, name: str) -> torch.Tensor:
        local = self._local(getattr(self, name))
        if self.weight_transform is None:
            return local
        return self.weight_transform(name, local, self.dispatcher.local_expert_ids)

    def extra_repr(self) -> str:
        ids = self.dispatcher.local_expert_ids
        return f"num_experts={self.num_experts}, local_experts=[{ids.start}, {ids.stop})"
