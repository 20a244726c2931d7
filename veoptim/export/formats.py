"""Export formats of a training checkpoint and their atomic publication.

``hf`` writes the full model as a Hugging Face directory (``write_hf_export``, the same
writer the end-of-run export uses). ``peft`` (the LoRA adapter directory) and ``merged``
(the LoRA adapters merged into the full model) need a LoRA checkpoint
(``lora_formats.py``). ``dcp`` copies the whole training checkpoint with DCP's own shard
layout (``dcp_format.py``: for torch's tools; a checkpoint of kind ``checkpoint``). Every
format is published under ``<out>/<name>`` by the checkpoint publisher, kind ``hf_export``
unless said otherwise: a crash leaves the previous export published.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from veoptim.checkpoint.layout import KIND_CHECKPOINT
from veoptim.checkpoint.publish import Published, Publisher
from veoptim.errors import CheckpointError, ConfigError
from veoptim.export.dcp_format import write_dcp
from veoptim.export.hf_format import KIND_HF_EXPORT, export_dtype, write_hf_export
from veoptim.export.lora_formats import write_merged, write_peft
from veoptim.export.source import (
    CheckpointSource,
    model_inventory,
    open_checkpoint,
    read_model_tensors,
)

FORMATS = ("hf", "peft", "merged", "dcp")
LORA_FORMATS = ("peft", "merged")


@dataclass(frozen=True)
class ExportOptions:
    """How to write: the ``export.*`` settings a CLI user passes as flags."""

    dtype: str = "bf16"  # bf16 | fp32 | preserve
    max_shard_size_mb: int = 2048
    allow_other_base: bool = False  # peft/merged: a base whose content differs is accepted


#: A writer fills ``out_dir`` (an unpublished version directory) from the checkpoint.
Writer = Callable[[CheckpointSource, Path, ExportOptions], None]


def write_hf(source: CheckpointSource, out_dir: Path, options: ExportOptions) -> None:
    """The full model as an HF directory (a full fine-tune's checkpoint)."""
    if source.has_lora:
        raise CheckpointError(
            f"{source.version} is a LoRA checkpoint; export it with --format peft (the adapter) "
            "or --format merged (the full model with the adapters merged in)."
        )
    tensors = read_model_tensors(source, model_inventory(source))
    write_hf_export(
        tensors, source.model, source.tokenizer, out_dir,
        dtype=options.dtype, max_shard_size_mb=options.max_shard_size_mb,
    )  # fmt: skip


WRITERS: dict[str, Writer] = {
    "hf": write_hf, "peft": write_peft, "merged": write_merged, "dcp": write_dcp,
}  # fmt: skip
#: Formats whose result is not an HF export: the DCP copy is a resumable training checkpoint.
KINDS = {"dcp": KIND_CHECKPOINT}


def check_format(source: CheckpointSource, fmt: str) -> Writer:
    """The writer of ``fmt`` for ``source``, or a one-line error saying what fits."""
    if fmt not in FORMATS:
        raise ConfigError(f"export format must be one of {list(FORMATS)}, got {fmt!r}.")
    if fmt in LORA_FORMATS and not source.has_lora:
        raise CheckpointError(
            f"{source.version} is not a LoRA checkpoint (it has no adapter weights); "
            f"--format {fmt} needs the checkpoint of a LoRA run, use --format hf for a full "
            "fine-tune."
        )
    return WRITERS[fmt]


def export_checkpoint(
    checkpoint: str | Path,
    out_root: str | Path,
    name: str,
    *,
    fmt: str = "hf",
    options: ExportOptions = ExportOptions(),  # noqa: B008 - frozen, shared safely
    fsync: bool = True,
) -> Published:
    """Publish ``<out_root>/<name>`` as the ``fmt`` export of ``checkpoint``.

    Everything that can be checked without reading tensors (the checkpoint, the format, the
    dtype) is checked before the version directory is created.
    """
    export_dtype(options.dtype)
    source = open_checkpoint(checkpoint)
    writer = check_format(source, fmt)
    pending = Publisher(out_root, fsync=fsync, run=source.run).begin(
        name, kind=KINDS.get(fmt, KIND_HF_EXPORT), step=source.step, prunable=False
    )
    try:
        writer(source, pending.path, options)
    except Exception as exc:
        pending.abort(exc)  # raises the CheckpointError; the previous export stays published
        raise
    except BaseException:
        pending.discard()  # KeyboardInterrupt: never published, directory removed
        raise
    return pending.commit()
