"""The export registry: every format, and the one door every export goes through.

A format is one ``ExportFormat`` line in ``_BUILTIN`` (or one ``register`` call): its
name, its writer, the manifest kind it publishes, whether it needs a LoRA model, and the
one-line refusal when the model does not fit. Three callers select by name:

- the end of a run and its cadence (``callbacks/hf_export.py``): ``publish_export`` with
  the live model (``run_format`` maps ``export.merge_lora`` and ``lora.enabled`` to a name);
- the slots (``veoptim/slots/export.py``): ``publish_export("peft", ...)`` with a slot's
  adapter;
- ``veoptim-export`` (``tasks/export.py``): ``export_checkpoint``, which rebuilds the model
  state from a checkpoint (``checkpoint_state``) and then calls ``publish_export``.

A writer gets a ``ModelState`` and the unpublished version directory; the registry
publishes ``<root>/<name>`` atomically (a failure leaves the previous export published).
``dcp`` is the one checkpoint-copying entry: its writer copies the checkpoint, not a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.checkpoint import KIND_CHECKPOINT, Published, Publisher
from veoptim.config.schema import TrainerConfig
from veoptim.errors import CheckpointError, ConfigError
from veoptim.export.dcp_format import write_dcp
from veoptim.export.formats import publish_base_if_needed, write_hf, write_merged, write_peft
from veoptim.export.hf_format import KIND_HF_EXPORT, export_dtype
from veoptim.export.lora_formats import lora_model
from veoptim.export.model_state import ExportOptions, ModelState
from veoptim.export.source import (
    CheckpointSource,
    model_inventory,
    open_checkpoint,
    read_model_tensors,
)

_NOT_LORA = (
    "{origin} is not a LoRA checkpoint (it has no adapter weights); --format {name} needs the "
    "checkpoint of a LoRA run, use --format hf for a full fine-tune."
)


@dataclass(frozen=True)
class ExportFormat:
    """One export format: what it writes and what it needs."""

    name: str
    write: Callable[..., None]  # (ModelState | CheckpointSource, out_dir, ExportOptions)
    kind: str = KIND_HF_EXPORT  # the manifest kind of what it publishes
    needs_lora: bool | None = None  # True: a LoRA model only; False: a full model only
    refusal: str = ""  # one line ({origin}, {name}) when the model does not fit
    before: Callable[[ModelState, ExportOptions], None] | None = None  # before publication
    copies_checkpoint: bool = False  # the writer copies the checkpoint (no model state)


_BUILTIN = (
    ExportFormat("hf", write_hf, needs_lora=False, refusal=(
        "{origin} is a LoRA checkpoint; export it with --format peft (the adapter) or "
        "--format merged (the full model with the adapters merged in).")),
    ExportFormat("peft", write_peft, needs_lora=True, refusal=_NOT_LORA,
                 before=publish_base_if_needed),
    ExportFormat("merged", write_merged, needs_lora=True, refusal=_NOT_LORA),
    ExportFormat("dcp", write_dcp, kind=KIND_CHECKPOINT, copies_checkpoint=True),
)  # fmt: skip
_REGISTRY: dict[str, ExportFormat] = {entry.name: entry for entry in _BUILTIN}

#: The built-in formats (``names()`` adds the registered ones).
FORMATS = tuple(entry.name for entry in _BUILTIN)
LORA_FORMATS = tuple(entry.name for entry in _BUILTIN if entry.needs_lora)


def register(entry: ExportFormat) -> None:
    """Add a format; its name must be new."""
    if entry.name in _REGISTRY:
        raise ConfigError(f"export format {entry.name!r} is already registered.")
    _REGISTRY[entry.name] = entry


def unregister(name: str) -> None:
    """Remove a format added by ``register`` (the built-ins stay)."""
    if name in FORMATS:
        raise ConfigError(f"export format {name!r} is built in; it cannot be unregistered.")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """Every format, built-in first."""
    return tuple(_REGISTRY)


def lookup(name: str) -> ExportFormat:
    """The format called ``name``, or a one-line error listing the known ones."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"export format must be one of {list(_REGISTRY)}, got {name!r}.")
    return entry


def check(name: str, *, lora: bool, origin: str | Path) -> ExportFormat:
    """The format ``name`` for a model with (``lora``) or without LoRA adapters, or its
    one-line refusal naming ``origin``."""
    entry = lookup(name)
    if entry.needs_lora is not None and entry.needs_lora != lora:
        raise CheckpointError(entry.refusal.format(origin=origin, name=name))
    return entry


def run_format(cfg: TrainerConfig) -> str:
    """The format a run exports (``export.hf`` turns the exports on): ``peft`` for a LoRA
    run, ``merged`` with ``export.merge_lora``, ``hf`` for a full fine-tune."""
    if cfg.lora.enabled:
        return "merged" if cfg.export.merge_lora else "peft"
    return "hf"


def _publish(
    publisher: Publisher, entry: ExportFormat, name: str, step: int,
    fill: Callable[[Path], None], *, agreed: bool,
) -> Published:  # fmt: skip
    """``<root>/<name>`` filled by ``fill`` and published; a failure leaves the previous
    export published. An interrupt is agreed across ranks (``agreed``, a live export) or
    just discarded (one process, offline)."""
    pending = publisher.begin(name, kind=entry.kind, step=step, prunable=False)
    try:
        fill(pending.path)
    except Exception as exc:
        pending.abort(exc)  # raises the agreed CheckpointError
        raise
    except BaseException as exc:
        if not agreed:
            pending.discard()  # never published, directory removed
            raise
        try:
            pending.abort(exc)
        except CheckpointError:
            pass
        raise
    return pending.commit()


def publish_export(
    fmt: str, state: ModelState, root: Path, name: str, options: ExportOptions, *,
    agreed: bool = True,
) -> Published:  # fmt: skip
    """Publish ``state`` as ``<root>/<name>`` in format ``fmt`` (collective: every rank
    calls it; rank 0 writes the files)."""
    entry = check(fmt, lora=state.lora, origin=state.origin)
    if entry.copies_checkpoint:
        raise ConfigError(f"export format {fmt!r} copies a checkpoint; it exports no live model.")
    if entry.before is not None:
        entry.before(state, options)
    publisher = Publisher(root, fsync=state.fsync, run=state.run)
    return _publish(publisher, entry, name, state.step,
                    lambda out: entry.write(state, out, options), agreed=agreed)  # fmt: skip


def checkpoint_state(
    source: CheckpointSource, exports_root: Path, options: ExportOptions, *, fsync: bool = True
) -> ModelState:
    """The model state of a checkpoint: its LoRA model rebuilt with its base
    (``lora_model``), or the full model's weights read from DCP."""
    model: Any = source.model
    weights = None
    if source.has_lora:
        model = lora_model(source, options.allow_other_base)
    else:
        weights = read_model_tensors(source, model_inventory(source))
    return ModelState(model, source.cfg, source.tokenizer, source.step, Path(exports_root),
                      run=source.run, origin=str(source.version), lora=source.has_lora,
                      fsync=fsync, weights=weights)  # fmt: skip


def check_format(source: CheckpointSource, fmt: str) -> Callable[..., None]:
    """The writer of ``fmt`` for ``source``, or a one-line error saying what fits."""
    return check(fmt, lora=source.has_lora, origin=source.version).write


def export_checkpoint(
    checkpoint: str | Path,
    out_root: str | Path,
    name: str,
    *,
    fmt: str = "hf",
    options: ExportOptions = ExportOptions(),  # noqa: B008 - frozen, shared safely
    fsync: bool = True,
) -> Published:
    """Publish ``<out_root>/<name>`` as the ``fmt`` export of ``checkpoint`` (offline).

    Everything that can be checked without reading tensors (the checkpoint, the format, the
    dtype) is checked before the version directory is created.
    """
    export_dtype(options.dtype)
    source = open_checkpoint(checkpoint)
    entry = check(fmt, lora=source.has_lora, origin=source.version)
    if entry.copies_checkpoint:
        publisher = Publisher(out_root, fsync=fsync, run=source.run)
        return _publish(publisher, entry, name, source.step,
                        lambda out: entry.write(source, out, options), agreed=False)  # fmt: skip
    state = checkpoint_state(source, Path(out_root), options, fsync=fsync)
    return publish_export(fmt, state, Path(out_root), name, options, agreed=False)
