"""The parallel plan: FSDP2 x expert parallelism applied to a model, from config.

Gradient contract: the trainer backpropagates, per micro-batch,
``sum of token losses / global number of loss tokens`` (the count all-reduced
over the whole global batch). The plan makes every gradient reduction a SUM
(FSDP2 divide factor 1), so the resulting gradients equal the single-process
gradients of the global mean loss. Expert gradients are complete on their
owning ep rank (the all-to-all backward brings every token's contribution home)
and then summed over ``efsdp`` (and ``dp_replicate``) by FSDP.

Activation checkpointing (``model.activation_checkpointing``) is set on the decoder
layers by ``build_model`` before the plan and needs nothing here: each layer's
``forward`` is recomputed inside the FSDP2 unit's hooks, so parameter names and the
sharding are those of a run without it (``veoptim/models/activation_checkpointing.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from veoptim.config.schema import ParallelConfig
from veoptim.distributed.context import DistContext
from veoptim.distributed.expert_parallel import TokenDispatcher
from veoptim.distributed.grad_norm import clip_grad_norm_, total_grad_norm
from veoptim.distributed.layout import MESH_DIM_NAMES, LayoutMetadata, contiguous_expert_placement
from veoptim.distributed.mesh import ParallelMeshes, build_meshes
from veoptim.distributed.sizes import ParallelSizes, resolve_parallel_sizes
from veoptim.dtypes import resolve_dtype
from veoptim.errors import ConfigError, DistributedError
from veoptim.models.attention import FLASH, check_attn_implementation
from veoptim.models.experts import ExpertParallelExperts, find_fused_experts
from veoptim.models.sharded_load import SafetensorsShards

GRADIENT_DIVIDE_FACTOR = 1.0  # SUM: the loss is already normalised by the global token count


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DistributedError(
            f"the parallel plan expects a transformers causal LM with decoder layers at model.model.layers; "
            f"found {type(model).__name__} without them."
        )
    return layers


@dataclass
class ParallelPlan:
    """Sizes, meshes and the operations that depend on them; build with :func:`build_parallel_plan`."""

    sizes: ParallelSizes
    ctx: DistContext
    num_experts: int
    mp_policy: MixedPrecisionPolicy
    meshes: ParallelMeshes | None  # None in a single process

    # ---- data-parallel coordinates -------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Number of distinct data shards: every rank of the world reads its own."""
        return self.sizes.world

    @property
    def dp_rank(self) -> int:
        """This rank's data shard, in (dp_replicate, efsdp, ep) mesh order."""
        if self.meshes is None:
            return 0
        return self.meshes.dp.get_local_rank()

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    # ---- applying the plan ---------------------------------------------------------
    def apply(self, model: nn.Module, shards: SafetensorsShards | None = None) -> nn.Module:
        """Move ``model`` to the device, split experts over ``ep``, shard with FSDP2 (in place).

        In a single process the model is only moved to the device. With several ranks,
        every shard (and every buffer) is then filled from rank 0's model, so ranks other
        than 0 may pass a model built on the meta device (no storage): host memory holds
        one full model per job instead of one per rank, and all ranks start from
        bitwise the weights a single process would have.

        With ``shards`` (the weight files of ``model.path``), every rank passes a model
        whose parameters are on the meta device and its buffers real, and fills its own
        shards from the files: no rank holds the full model, nothing is broadcast.
        """
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attn == FLASH:  # only now is run.device=auto resolved
            check_attn_implementation(attn, self.device.type)
        if shards is not None:
            return self._apply_from_files(model, shards)
        on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        if on_meta and (self.meshes is None or self.ctx.is_main):
            raise DistributedError(
                "rank 0 (and a single process) must pass a materialised model to the parallel "
                "plan; only the other ranks of a distributed run may build it on the meta device."
            )
        if not on_meta:
            model.to(self.device)
        if self.meshes is None:
            return model
        # Rank 0's full tensors (references, no copy) are the source of every shard.
        source = dict(model.state_dict()) if self.ctx.is_main else {}
        self._shard(model)
        if on_meta:
            model.to_empty(device=self.device)
        set_model_state_dict(
            model,
            source,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        for buffer in model.buffers():  # non-persistent buffers (rotary tables) too
            dist.broadcast(buffer, src=0)
        return model

    def _apply_from_files(self, model: nn.Module, shards: SafetensorsShards) -> nn.Module:
        buffers = {name: b.to(self.device) for name, b in model.named_buffers()}
        if any(b.is_meta for b in buffers.values()):
            raise DistributedError(
                "loading shards from model.path needs the model's buffers materialised (build "
                "it with build_model(..., on_meta=True, buffers=True))."
            )
        if self.meshes is not None:
            self._shard(model)
        model.to_empty(device=self.device)
        shards.load_into(model)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name not in shards.files:  # computed at construction, not stored
                    buffer.copy_(buffers[name])
        return model

    def _shard(self, model: nn.Module) -> None:
        """Split experts over ``ep`` and apply FSDP2 per decoder layer, then to the root."""
        assert self.meshes is not None
        layers = decoder_layers(model)
        experts = find_fused_experts(model)
        if self.sizes.ep > 1:
            if not experts:
                raise DistributedError(
                    f"parallel.ep={self.sizes.ep} but the model has no fused MoE experts modules."
                )
            self._apply_expert_parallel(model, experts)
        fsdp_modules: list[FSDPModule] = []
        for layer in layers:
            for ep_experts in layer.modules():
                if isinstance(ep_experts, ExpertParallelExperts):
                    fsdp_modules.append(self._shard_experts(ep_experts))
            fsdp_modules.append(
                fully_shard(layer, mesh=self.meshes.dense_fsdp, mp_policy=self.mp_policy)
            )
        fsdp_modules.append(
            fully_shard(model, mesh=self.meshes.dense_fsdp, mp_policy=self.mp_policy)
        )
        for module in fsdp_modules:
            module.set_gradient_divide_factor(GRADIENT_DIVIDE_FACTOR)
            module.set_force_sum_reduction_for_comms(True)

    def _apply_expert_parallel(
        self, model: nn.Module, experts: list[tuple[nn.Module, str, nn.Module]]
    ) -> None:
        assert self.meshes is not None
        group = self.meshes.ep.get_group()
        for parent, attr, module in experts:
            if module.gate_up_proj.shape[0] != self.num_experts:
                raise DistributedError(
                    f"build_parallel_plan was given num_experts={self.num_experts}, but "
                    f"{type(parent).__name__}.{attr} has {module.gate_up_proj.shape[0]} experts."
                )
            dispatcher = TokenDispatcher(group, self.num_experts)
            setattr(parent, attr, ExpertParallelExperts(module, dispatcher, self.meshes.ep))

    def _shard_experts(self, module: nn.Module) -> FSDPModule:
        """FSDP over efsdp: dim 0 (experts) when it divides evenly, else dim 1."""
        assert self.meshes is not None
        efsdp, num_local = self.sizes.efsdp, self.num_experts // self.sizes.ep

        def placement(param: nn.Parameter) -> Shard:
            if num_local % efsdp == 0:
                return Shard(0)
            if param.shape[1] % efsdp == 0:
                return Shard(1)
            raise ConfigError(
                f"expert parameter of shape {tuple(param.shape)} cannot be sharded evenly over efsdp={efsdp}: "
                f"neither the {num_local} local experts nor dim 1 ({param.shape[1]}) divide; choose another ep."
            )

        return fully_shard(
            module,
            mesh=self.meshes.expert_fsdp,
            mp_policy=self.mp_policy,
            shard_placement_fn=placement,
        )

    # ---- collectives the trainer needs ---------------------------------------------
    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over all ranks (token counts, logged losses); returns a new tensor."""
        out = x.detach().clone()
        if self.meshes is not None:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.meshes.dp.get_group())
        return out

    @staticmethod
    def reshard(model: nn.Module) -> None:
        """Free the gathered parameters a forward without a backward left behind.

        FSDP keeps the root module's parameters gathered after its forward, for the
        backward that follows; after a forward with no backward (evaluation, sampling)
        they stay gathered, and code that reads a parameter then sees the gathered tensor
        (a view into the all-gather buffer) instead of its shard. No-op without FSDP."""
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm over every mesh, in FP32, without clipping."""
        return total_grad_norm([p.grad for p in model.parameters() if p.grad is not None])

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every mesh; returns the norm before clipping."""
        return clip_grad_norm_(model.parameters(), max_norm)

    def layout_metadata(self) -> LayoutMetadata:
        """What checkpoints record about this layout."""
        s = self.sizes
        return LayoutMetadata(
            mesh_dim_names=MESH_DIM_NAMES,
            mesh_dim_sizes=(s.dp_replicate, s.efsdp, s.ep),
            world_size=s.world,
            ep_size=s.ep,
            num_experts=self.num_experts,
            expert_placement=contiguous_expert_placement(self.num_experts, s.ep),
        )


def build_parallel_plan(cfg: ParallelConfig, ctx: DistContext, num_experts: int) -> ParallelPlan:
    """Validate ``cfg`` against the world size and model, and build the mesh (only when world > 1).

    ``num_experts`` is the model's experts per MoE layer (0 for dense models).
    """
    sizes = resolve_parallel_sizes(cfg, ctx.world_size, num_experts)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=resolve_dtype(cfg.param_dtype, "parallel.param_dtype"),
        reduce_dtype=resolve_dtype(cfg.reduce_dtype, "parallel.reduce_dtype"),
    )
    meshes = build_meshes(ctx.device.type, sizes) if ctx.world_size > 1 else None
    return ParallelPlan(
        sizes=sizes, ctx=ctx, num_experts=num_experts, mp_policy=mp_policy, meshes=meshes
    )
