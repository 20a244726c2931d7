"""The model before sharding: where ``model.path``'s files allow, every rank loads its own
shards later (parameters on meta everywhere); otherwise rank 0 builds it in full and the
parallel plan broadcasts its weights to the other ranks' shards."""

from __future__ import annotations

import logging

from torch import nn

from veoptim.config.schema import TrainerConfig
from veoptim.distributed import DistContext
from veoptim.lora import apply_lora
from veoptim.models import build_model
from veoptim.models.sharded_load import SafetensorsShards

log = logging.getLogger(__name__)


def unsharded_model(
    cfg: TrainerConfig,
    ctx: DistContext,
    vocab: int,
    special: dict[str, int],
    *,
    with_lora: bool = True,
) -> tuple[nn.Module, SafetensorsShards | None]:
    """The model to hand to ``ParallelPlan.apply``, and the weight files to fill its shards
    from (None: rank 0's weights are broadcast, or one process). LoRA runs load through
    rank 0: the adapters' initial values come from there."""
    lora = with_lora and cfg.lora.enabled
    if cfg.model.path and ctx.world_size > 1 and not lora:
        files = SafetensorsShards.open(cfg.model.path)
        if files is not None:
            skeleton = build_model(cfg.model, vocab, special, on_meta=True, buffers=True)
            missing = files.missing(skeleton)
            if not missing:
                log.info("each rank reads its own shards of model.path %s", cfg.model.path)
                return skeleton, files
            log.info(
                "model.path %s stores %d of the model's tensors under other names (e.g. %s): "
                "rank 0 loads it and broadcasts the shards",
                cfg.model.path, len(missing), missing[0],
            )  # fmt: skip
    on_meta = ctx.world_size > 1 and not ctx.is_main
    model = build_model(cfg.model, vocab, special, on_meta=on_meta)
    if lora:  # adapters join the model before it is sharded
        apply_lora(model, cfg.lora, seed=cfg.model.init_seed)
    return model, None
