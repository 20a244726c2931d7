"""A self-hosted training service speaking the Tinker API (the ``tinker`` SDK's wire
protocol) over the multi-LoRA :class:`~veoptim.slots.SlotTrainer`: one training
client is one slot. See ``docs/service.md``.

Layers, each calling only those below it (``docs/service.md``, "How it is built"): HTTP
(``app``, ``routes/``) -> the engine (``engine``, ``futures``) -> what a request does
(``backend``, ``checkpoints``, ``sampler``, ``sessions``, ``catalog``) -> the slots
(``slots``, the one owner of slot occupancy, over ``ranks``), with the data layer
(``db``: every SQL statement) beneath them. Beside them: ``config``, ``errors``,
``paths``, ``auth``, ``wire``, ``losses``, ``links``, ``hub_cache``, ``served``,
``metrics``, ``runtime`` (the parts put together) and ``server`` (uvicorn, signals).
"""

from veoptim.service.config import ServeConfig

__all__ = ["ServeConfig"]
