"""Device abstraction, process groups and the FSDP2 x expert-parallel plan.

Public API (what tasks and the trainer call)::

    ctx = init_distributed(cfg.run.device, cfg.parallel.backend, os.environ)
    setup_logging(ctx, cfg.logging.level)
    plan = build_parallel_plan(cfg.parallel, ctx, num_experts)
    model = plan.apply(model)

The names below are imported on first use (PEP 562), so importing a light submodule
such as ``veoptim.distributed.agreement`` does not pull in torch, FSDP or DTensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names

if TYPE_CHECKING:
    from veoptim.distributed.context import DistContext, init_distributed
    from veoptim.distributed.device import resolve_backend, resolve_device
    from veoptim.distributed.layout import LAYOUT_FORMAT_VERSION, MESH_DIM_NAMES, LayoutMetadata
    from veoptim.distributed.log import setup_logging
    from veoptim.distributed.plan import ParallelPlan, build_parallel_plan
    from veoptim.distributed.sizes import ParallelSizes, resolve_parallel_sizes

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "DistContext": "context",
    "init_distributed": "context",
    "resolve_backend": "device",
    "resolve_device": "device",
    "LAYOUT_FORMAT_VERSION": "layout",
    "MESH_DIM_NAMES": "layout",
    "LayoutMetadata": "layout",
    "setup_logging": "log",
    "ParallelPlan": "plan",
    "build_parallel_plan": "plan",
    "ParallelSizes": "sizes",
    "resolve_parallel_sizes": "sizes",
}

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

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
