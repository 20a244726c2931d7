"""A self-hosted training service speaking the Tinker API (the ``tinker`` SDK's wire
protocol) over the multi-LoRA :class:`~veoptim.lora.slots.SlotTrainer`: one training
client is one slot. See ``docs/service.md``.

Modules, one job each: ``config`` (the ``serve`` section), ``errors`` (what a client is
told), ``paths`` (``tinker://`` references), ``auth`` (API keys and tenants), ``db``
(the SQLite state), ``futures`` (request results and long polls), ``wire`` (protobuf
bodies through the SDK's own schema), ``losses`` (the loss registry), ``engine`` (the
worker that owns the trainer), ``app`` (the HTTP routes), ``server`` (uvicorn, signals).
"""

from veoptim.service.config import ServeConfig

__all__ = ["ServeConfig"]
