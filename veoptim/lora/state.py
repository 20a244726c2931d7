"""A LoRA run's model state: the adapters only, plus a fingerprint of the frozen base.

The base is not saved with every checkpoint (it does not change); instead the
checkpoint records what it was: for a model loaded from ``model.path`` its config, a
hash of its weight index (the safetensors headers or index file: names, shapes, dtypes
and offsets) and the content hash of its weights (``veoptim.content_hash``: every
tensor's bytes, so a base retrained under the same path is told apart); for a model
built from config, that config and its init seed. The base's path is recorded too, to
name it in messages, but a base that moved is still the same base. A resume against
another base fails closed before anything is written, unless ``lora.allow_other_base``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from veoptim.checkpoint import ComponentState, SavedComponent, Staged
from veoptim.content_hash import files_content_hash
from veoptim.errors import CheckpointError
from veoptim.state.model import copy_installer, module_inventory

BASE = "base"
ADAPTERS_ONLY = StateDictOptions(ignore_frozen_params=True)
#: Config fields that say nothing about the weights (they change with library versions).
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "architectures", "dtype")
#: Fingerprint keys that describe the base for people and are never compared.
DESCRIPTIVE_KEYS = ("path",)
#: How the base's weights were stored while the adapters trained (``model.quant``); absent
#: (every fingerprint before 4-bit bases, and every full-precision one): "none".
QUANT, NO_QUANT = "quant", "none"
#: The config key and the command-line flag that accept a base with another fingerprint.
ALLOW_KEY, ALLOW_FLAG = "lora.allow_other_base=true", "--allow-other-base"
log = logging.getLogger(__name__)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _weight_index(path: Path) -> str:
    """Hash of the weight files' index: ``*.index.json`` files, else every safetensors
    header (tensor names, dtypes, shapes, offsets), without reading the weights."""
    digest = hashlib.sha256()
    indexes = sorted(path.glob("*.index.json"))
    files = indexes or sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no safetensors weights to fingerprint.")
    for file in files:
        digest.update(file.name.encode())
        if file.suffix == ".json":
            digest.update(file.read_bytes())
            continue
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(length))
    return digest.hexdigest()


def base_fingerprint(
    model_config: Any, model_path: str, init_seed: int, quant: str = NO_QUANT
) -> dict[str, Any]:
    """What identifies the frozen base (JSON): its config, and its weights' index and
    content hash, or its init seed; its quantization (``model.quant``, recorded when not
    "none"): the same weights in 4 bits are another base to the adapters; plus its path
    (descriptive, never compared)."""
    config = {k: v for k, v in model_config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS}
    if model_path:
        path = Path(model_path)
        source = {
            "weight_index": _weight_index(path),
            "content": files_content_hash(path),
            "path": str(path.absolute()),
        }
    else:
        source = {"init_seed": init_seed}
    quantized = {QUANT: quant} if quant != NO_QUANT else {}
    return {"model_type": config.get("model_type"), "config": _digest(config), **source,
            **quantized}  # fmt: skip


def quantization(fingerprint: dict[str, Any] | None) -> str:
    """How the fingerprinted base was stored ("none" when not recorded)."""
    return (fingerprint or {}).get(QUANT, NO_QUANT)


def fingerprint_differences(
    saved: dict[str, Any] | None, live: dict[str, Any] | None, *, with_quant: bool = True
) -> list[str]:
    """The keys on which two base fingerprints differ. A key the saved fingerprint lacks
    (``content``, recorded only since content hashes exist) is not compared; the
    quantization always is (absent: "none"), unless ``with_quant`` is False."""
    saved, live = saved or {}, live or {}
    keys = (set(saved) if saved else set(live)) - set(DESCRIPTIVE_KEYS) - {QUANT}
    differs = [k for k in keys if saved.get(k) != live.get(k)]
    if with_quant and quantization(saved) != quantization(live):
        differs.append(QUANT)
    return sorted(differs)


def describe_base(fingerprint: dict[str, Any] | None, show_quant: bool = False) -> str:
    """A base as a person recognises it: its path and content hash, or its init seed (and
    how it was stored, when recorded or ``show_quant``)."""
    fp = fingerprint or {}
    show_quant = show_quant or QUANT in fp
    if "init_seed" in fp:
        stored = f", stored {quantization(fp)}" if show_quant else ""
        return (
            f"the {fp.get('model_type')} model built from config with init_seed "
            f"{fp['init_seed']}{stored}"
        )
    where = fp.get("path", "a model directory")
    content = fp.get("content")
    stored = f", stored {quantization(fp)}" if show_quant else ""
    if content:
        return f"{where} (content {content[:12]}{stored})"
    return f"{where} (content not recorded{stored})"


def base_mismatch(lead: str, saved: dict[str, Any] | None, live: dict[str, Any]) -> str:
    """``lead`` (e.g. "the adapters in X were trained on another base model"), what differs,
    and both bases by name."""
    differs = fingerprint_differences(saved, live)
    quant = QUANT in differs
    return (
        f"{lead} ({', '.join(differs)} differ{'s' if len(differs) == 1 else ''}): trained on "
        f"{describe_base(saved, quant)}, found {describe_base(live, quant)}"
    )


def refuse_other_base(
    lead: str, saved: dict[str, Any] | None, live: dict[str, Any], flag: str
) -> CheckpointError:
    """The one-line refusal, naming both bases and the ``flag`` that accepts the other one."""
    return CheckpointError(
        f"{base_mismatch(lead, saved, live)}; use the base it was trained on, or pass {flag} "
        "to use this one on purpose."
    )


def check_base(
    saved: SavedComponent, fingerprint: dict[str, Any], allow_other: bool = False
) -> None:
    """Refuse adapters saved on another base than ``fingerprint`` names (CheckpointError),
    or with ``allow_other`` (``lora.allow_other_base``) only say so in the log."""
    found = saved.json.get(BASE) if isinstance(saved.json, dict) else None
    if not fingerprint_differences(found, fingerprint):
        if isinstance(found, dict) and "content" not in found and "content" in fingerprint:
            log.warning("the adapters in %s record no content hash of their base (saved before "
                        "veoptim kept one): only its config and layout are checked", saved.path)  # fmt: skip
        return
    lead = f"the adapters in {saved.path} were trained on another base model"
    if not allow_other:
        raise refuse_other_base(lead, found, fingerprint, ALLOW_KEY)
    log.warning("%s; going on as %s asks", base_mismatch(lead, found, fingerprint), ALLOW_KEY)


class LoRAModelState:
    """The trainable (adapter) parameters of ``model``; ``fingerprint`` names its base."""

    def __init__(
        self, model: nn.Module, fingerprint: dict[str, Any], allow_other_base: bool = False
    ) -> None:
        self.model, self.fingerprint = model, fingerprint
        self.allow_other_base = allow_other_base

    def state(self) -> ComponentState:
        return ComponentState(
            tensors=get_model_state_dict(self.model, options=ADAPTERS_ONLY),
            json={BASE: self.fingerprint},
        )

    def stage(self, saved: SavedComponent) -> Staged:
        check_base(saved, self.fingerprint, self.allow_other_base)
        live = get_model_state_dict(self.model, options=ADAPTERS_ONLY)
        buffers = {fqn: torch.empty_like(t) for fqn, t in live.items()}

        def install_through_dcp() -> None:
            set_model_state_dict(self.model, buffers, options=StateDictOptions(strict=False))

        install = copy_installer(self.model, live, buffers) or install_through_dcp
        return Staged(expected=module_inventory(live), buffers=buffers, install=install)
