"""Mixture-of-experts layers under expert parallelism.

transformers 5.x stores the experts of a MoE block as fused 3D parameters
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) in one module
called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:class:`ExpertParallelExperts` replaces that module with one that holds only this
rank's experts (as a DTensor ``Shard(0)`` over the ep mesh, so state-dict keys
and global shapes stay those of the original model) and computes them on the
tokens a dispatcher brings in. This module knows the model side; the
communication is behind the :class:`Dispatcher` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


class Dispatcher(Protocol):
    """Moves (token, expert) pairs to the rank that owns the expert and back."""

    num_experts: int
    num_local: int
    local_expert_ids: range

    def dispatch(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], Any]: ...

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


def local_experts_forward(
    tokens: torch.Tensor,
    tokens_per_expert: list[int],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert; every expert runs, even on zero rows.

    Running empty experts keeps each expert weight in the autograd graph, so
    every rank produces a (zero) gradient for it and FSDP's gradient
    reduce-scatter sees the same tensors on all ranks.
    """
    outs = []
    for e, chunk in enumerate(torch.split(tokens, tokens_per_expert)):
        gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down[e]))
    return torch.cat(outs)


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
        rows, per_expert, state = self.dispatcher.dispatch(hidden_states, top_k_index)
        gate_up, down = (self._weight(name) for name in FUSED_EXPERT_PARAMS)
        out = local_experts_forward(rows, per_expert, gate_up, down, self.act_fn)
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
