"""Every export of a model, through one registry (``registry.py``; see docs/exports.md).

Live: the end of a run and its cadence (``callbacks/hf_export.py``) and the slots hand
``publish_export`` the training model. Offline (no training job): ``veoptim-export``
(``export_checkpoint``) opens a checkpoint (``source.py``), rebuilds its model state and
calls the same writers; ``veoptim-generate`` (``generate.py``) samples from an export.
"""

from veoptim.export.formats import write_hf
from veoptim.export.model_state import ExportOptions, ModelState, Writer
from veoptim.export.registry import (
    FORMATS,
    LORA_FORMATS,
    ExportFormat,
    check,
    check_format,
    checkpoint_state,
    export_checkpoint,
    lookup,
    names,
    publish_export,
    register,
    run_format,
    unregister,
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
    "ExportFormat",
    "ExportOptions",
    "ModelState",
    "Writer",
    "check",
    "check_format",
    "checkpoint_state",
    "export_checkpoint",
    "lookup",
    "model_inventory",
    "names",
    "open_checkpoint",
    "publish_export",
    "read_model_tensors",
    "register",
    "run_format",
    "unregister",
    "write_hf",
]
