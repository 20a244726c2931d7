"""Device abstraction, process groups and the FSDP2 x expert-parallel plan.

Public API (what tasks and the trainer call)::

    ctx = init_distributed(cfg.run.device, cfg.parallel.backend, os.environ)
    setup_logging(ctx, cfg.logging.level)
    plan = build_parallel_plan(cfg.parallel, ctx, num_experts)
    model = plan.apply(model)
"""

from veoptim.distributed.context import DistContext, init_distributed
from veoptim.distributed.device import resolve_backend, resolve_device
from veoptim.distributed.layout import LAYOUT_FORMAT_VERSION, MESH_DIM_NAMES, LayoutMetadata
from veoptim.distributed.log import setup_logging
from veoptim.distributed.plan import ParallelPlan, build_parallel_plan
from veoptim.distributed.sizes import ParallelSizes, resolve_parallel_sizes

__all__ = [
    "LAYOUT_FORMAT_VERSION",
    "MESH_DIM_NAMES",
    "DistContext",
    "LayoutMetadata",
    "ParallelPlan",
    "ParallelSizes",
    "build_parallel_plan",
    "init_distributed",
    "resolve_backend",
    "resolve_device",
    "resolve_parallel_sizes",
    "setup_logging",
]
