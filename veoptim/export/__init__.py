"""Offline exports of training checkpoints (``veoptim-export``; see docs/exports.md)."""

from veoptim.export.formats import (
    FORMATS,
    LORA_FORMATS,
    ExportOptions,
    Writer,
    check_format,
    export_checkpoint,
    write_hf,
)
from veoptim.export.source import (
    LORA_KEY_MARKERS,
    CheckpointSource,
    model_inventory,
    open_checkpoint,
    read_model_tensors,
)

__all__ = [
    "FORMATS",
    "LORA_FORMATS",
    "LORA_KEY_MARKERS",
    "CheckpointSource",
    "ExportOptions",
    "Writer",
    "check_format",
    "export_checkpoint",
    "model_inventory",
    "open_checkpoint",
    "read_model_tensors",
    "write_hf",
]
