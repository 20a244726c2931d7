"""Expert-parallel token dispatch and combine over the ``ep`` process group.

Each ep rank owns a contiguous block of ``num_experts / ep`` experts. A token
routed to ``k`` experts is sent once per (token, expert) pair to the rank owning
that expert, computed there, sent back, and returned in the original
(token, k) order. Both all-to-alls are autograd functions whose backward is the
reverse all-to-all, so gradients reach the tokens' home ranks and the expert
weights of the owning ranks.

Host synchronisation: one per layer and step. The all-to-alls take their split sizes
as Python ints, so the per-expert counts must reach the host once; :meth:`dispatch`
fetches every count it needs (sent and received) in a single ``.tolist()`` and
otherwise uses only ops whose output sizes are known on the host (no ``.item()``,
``bincount``, ``nonzero``, or ``repeat_interleave`` without ``output_size``). Combine
and both backwards reuse those sizes. Counted by ``tests/models/test_grouped_experts.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from veoptim.models.experts import RowGroups


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` with uneven splits along dim 0."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
    ):  # type: ignore[override]
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad_in = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Send ``in_splits[j]`` rows of ``x`` to rank ``j``; receive ``out_splits[j]`` rows from it."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class DispatchState:
    """What :meth:`TokenDispatcher.combine` needs to undo a dispatch."""

    num_pairs: int
    num_valid: int
    unsort: torch.Tensor  # inverse of the expert-sorted order of (token, k) pairs
    send_splits: list[int]
    recv_splits: list[int]
    ungroup: (
        torch.Tensor
    )  # inverse of the (source rank, expert) -> (expert, source rank) regrouping


class TokenDispatcher:
    """Routes (token, expert) pairs to the ep rank owning the expert and back."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the ep group size {self.ep}."
            )
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this rank owns."""
        return range(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)

    def dispatch(
        self, hidden: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, RowGroups, DispatchState]:
        """Send tokens to their experts' ranks.

        ``hidden`` is ``[T, H]``, ``expert_ids`` ``[T, K]`` global expert ids
        (ids ``>= num_experts`` mark dropped pairs). Returns the rows this rank
        must compute, sorted by local expert, and their row count per local expert
        (on the host and, as group ends, on the device).
        """
        num_tokens, top_k = expert_ids.shape
        num_experts, num_local = self.num_experts, self.num_local
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        bins = flat.clamp(max=num_experts).long()  # bin num_experts collects dropped pairs
        counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
        counts = counts.scatter_add_(0, bins, torch.ones_like(bins))[:num_experts]
        recv_counts = torch.empty_like(counts)  # [ep * num_local] from each source
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        # The layer's one host synchronisation: every split size at once.
        host = torch.cat([counts, recv_counts]).tolist()
        send_splits = [sum(host[r * num_local : (r + 1) * num_local]) for r in range(self.ep)]
        received_counts = host[num_experts:]  # (source rank, local expert)
        recv_splits = [
            sum(received_counts[r * num_local : (r + 1) * num_local]) for r in range(self.ep)
        ]
        per_expert = [sum(received_counts[e::num_local]) for e in range(num_local)]
        num_valid = sum(send_splits)
        send_rows = hidden[order[:num_valid] // top_k]
        received = all_to_all(send_rows, recv_splits, send_splits, self.group)
        # Received rows are ordered (source rank, local expert); group them by local expert.
        local_ids = torch.arange(num_local, device=counts.device).repeat(self.ep)
        row_expert = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(recv_splits))
        group_order = torch.argsort(row_expert, stable=True)
        state = DispatchState(
            num_pairs=num_tokens * top_k,
            num_valid=num_valid,
            unsort=torch.argsort(order),
            send_splits=send_splits,
            recv_splits=recv_splits,
            ungroup=torch.argsort(group_order),
        )
        ends = torch.cumsum(recv_counts.view(self.ep, num_local).sum(0), dim=0, dtype=torch.int32)
        return received[group_order], RowGroups(per_expert, ends), state

    def combine(self, expert_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Return computed rows to their home ranks: ``[T * K, H]`` in (token, k) order (dropped pairs are 0)."""
        back = all_to_all(
            expert_out[state.ungroup], state.send_splits, state.recv_splits, self.group
        )
        dropped = state.num_pairs - state.num_valid
        if dropped:
            back = torch.cat([back, back.new_zeros((dropped, *back.shape[1:]))])
        return back[state.unsort]
