"""The attention kernels a model may be built with (``model.attn_implementation``)."""

from __future__ import annotations

import importlib.util

from veoptim.errors import ConfigError

#: transformers' names; ``sdpa`` is torch's scaled_dot_product_attention (the default);
#: ``sdpa_varlen`` is veoptim's (``varlen.py``): each packed document attended alone.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2", "sdpa_varlen")
FLASH = "flash_attention_2"
VARLEN = "sdpa_varlen"


def check_attn_implementation(name: str, device_type: str | None = None) -> None:
    """Refuse an unknown kernel, and flash attention where it cannot run (no ``flash_attn``
    package, or a device other than CUDA), before transformers fails deep in a forward.

    ``device_type`` None checks only what does not depend on the device.
    """
    if name not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {name!r}."
        )
    if name != FLASH:
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation=flash_attention_2 needs the flash_attn package, which is "
            "not installed; install flash-attn or use model.attn_implementation=sdpa."
        )
    if device_type is not None and device_type != "cuda":
        raise ConfigError(
            f"model.attn_implementation=flash_attention_2 runs only on CUDA, but the device is "
            f"{device_type}; use model.attn_implementation=sdpa."
        )
