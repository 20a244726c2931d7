"""LoRA adapters in PEFT's on-disk format, and the merged full model.

A PEFT adapter directory holds ``adapter_model.safetensors`` (keys
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``: the adapter name is
dropped) and ``adapter_config.json``; ``peft.PeftModel.from_pretrained(base, dir)``
loads it. The state functions here gather sharded (FSDP2/EP) weights into full tensors,
a collective: every rank calls them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from veoptim.config.schema import LoRAConfig
from veoptim.errors import CheckpointError, ConfigError
from veoptim.lora.experts import EXPERT_PARAMS
from veoptim.lora.inject import lora_experts, lora_layers
from veoptim.lora.layer import DEFAULT_ADAPTER
from veoptim.lora.state import (
    ALLOW_FLAG,
    base_fingerprint,
    base_mismatch,
    fingerprint_differences,
    quantization,
    refuse_other_base,
)
from veoptim.models.quant import NF4Linear

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: The fingerprint of the base (``veoptim.lora.state.base_fingerprint``), in an adapter
#: directory and in an exported ``hf_base``.
BASE_FINGERPRINT_FILE = "veoptim_base.json"
BASE_LAYER = ".base_layer"
log = logging.getLogger(__name__)


def full_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (gathers a DTensor: collective)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu").contiguous()


def peft_adapter_state(model: nn.Module, name: str = DEFAULT_ADAPTER) -> dict[str, torch.Tensor]:
    """The adapter ``name`` of every LoRA layer, keyed and laid out as PEFT saves it.

    Expert adapters follow PEFT's ``target_parameters``: one wrapper per parameter, the
    last one outermost (``experts.lora_A``, the one before ``experts.base_layer.lora_A``);
    A stored as ``[E*r, in]``, B as ``[out, r*E]`` with the expert index fastest.
    """
    state: dict[str, torch.Tensor] = {}
    for fqn, layer in lora_layers(model).items():
        for kind in ("lora_A", "lora_B"):
            state[f"{PEFT_PREFIX}{fqn}.{kind}.weight"] = full_cpu(getattr(layer, kind)[name].weight)
    for fqn, experts in lora_experts(model).items():
        params = experts.param_names
        for depth, param in enumerate(reversed(params)):
            prefix = f"{PEFT_PREFIX}{fqn}." + "base_layer." * depth
            a = full_cpu(experts.adapters.lora_A[name][param])  # [E, r, in]
            b = full_cpu(experts.adapters.lora_B[name][param])  # [E, out, r]
            state[f"{prefix}lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
            state[f"{prefix}lora_B.weight"] = (
                b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
            )
    return state


def adapter_config(
    cfg: LoRAConfig, model: nn.Module, base_model_name_or_path: str
) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT: the targets are the adapted layers' short names (or
    the regex), so PEFT rebuilds exactly these layers."""
    targets: Any = cfg.target_regex or sorted({n.rsplit(".", 1)[-1] for n in lora_layers(model)})
    parameters = sorted(
        {
            ".".join(n.split(".")[-2:]) + f".{p}"
            for n, e in lora_experts(model).items()
            for p in e.param_names
        },
        key=lambda key: EXPERT_PARAMS.index(key.rsplit(".", 1)[-1]),
    )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.use_rslora,
        "target_modules": targets,
        "target_parameters": parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_adapter(
    out_dir: Path, state: dict[str, torch.Tensor], config: dict[str, Any]
) -> None:
    """Write a PEFT adapter directory (rank 0, after the collective gathers)."""
    save_file(state, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's state dict under its original names (no adapters), full tensors;
    a 4-bit base's Linear weights dequantized into the dtype it computes in (the weights
    its training forward used)."""
    state = {
        key.replace(BASE_LAYER, ""): full_cpu(value)
        for key, value in model.state_dict().items()
        if ".lora_A." not in key and ".lora_B." not in key
    }
    for fqn, module in model.named_modules():
        if isinstance(module, NF4Linear):
            state[f"{fqn}.weight".replace(BASE_LAYER, "")] = module.dequantized().cpu()
    return state


def merged_state(model: nn.Module, name: str = DEFAULT_ADAPTER) -> dict[str, torch.Tensor]:
    """The base with adapter ``name`` folded into each adapted weight, under the base's
    original names and dtype: the model PEFT's ``merge_and_unload`` would give."""
    state = base_state(model)
    for fqn, layer in lora_layers(model).items():
        key = f"{fqn}.weight"
        base = state[key]
        a = full_cpu(layer.lora_A[name].weight).float()
        b = full_cpu(layer.lora_B[name].weight).float()
        state[key] = (base.float() + (b @ a) * layer.specs[name].scaling).to(base.dtype)
    for fqn, experts in lora_experts(model).items():
        for param in experts.param_names:
            key = f"{fqn}.{param}"
            base = state[key]
            full_a = full_cpu(experts.adapters.lora_A[name][param]).float()
            full_b = full_cpu(experts.adapters.lora_B[name][param]).float()
            delta = torch.bmm(full_b, full_a) * experts.specs[name].scaling
            state[key] = (base.float() + delta).to(base.dtype)
    return state


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_adapter_base(
    adapter_dir: str | Path, base_dir: str | Path | None = None, *, allow_other: bool = False
) -> Path:
    """Check that the base an exported adapter names (or ``base_dir``) is still the base it
    was trained on, by the fingerprint the export recorded (``veoptim_base.json``); returns
    the base directory checked, raises ``CheckpointError`` naming both bases and the flag
    that accepts another one (``allow_other``: only a warning).

    The fingerprint is the base's config, its weight index and the content hash of its
    weights, or for a base built from config its ``model.init_seed`` (then the exported
    ``hf_base`` beside the adapter records its own): another model, size, layout or a
    retrained base of the same shapes is told apart.
    """
    adapter_dir = Path(adapter_dir)
    saved = _read_json(adapter_dir / BASE_FINGERPRINT_FILE)
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{adapter_dir} has no readable {BASE_FINGERPRINT_FILE} (not a veoptim adapter "
            "export, or one written before veoptim recorded its base); its base cannot be checked."
        )
    config = _read_json(adapter_dir / ADAPTER_CONFIG_FILE) or {}
    named = config.get("base_model_name_or_path", "")
    base = (
        Path(base_dir) if base_dir is not None else _base_directory(named, config.get("revision"))
    )
    if not (base / "config.json").is_file():
        raise CheckpointError(
            f"the base model of the adapter {adapter_dir} ({base}) is not a model directory "
            "(no config.json): it was removed or moved; pass the base it was trained on."
        )
    if "init_seed" in saved:  # built from config: the exported hf_base records its own
        found = _read_json(base / BASE_FINGERPRINT_FILE)
    else:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(base, local_files_only=True)
        if hasattr(model_config, "get_text_config"):
            model_config = model_config.get_text_config()
        found = base_fingerprint(model_config, str(base), 0)
    lead = f"the base model at {base} is not the one the adapter {adapter_dir} was trained on"
    found = found if isinstance(found, dict) else {"path": str(base)}
    if quantization(saved) != quantization(found):  # QLoRA adapters serve on their full base
        log.info(
            "the adapter %s trained on the %s-quantized weights of %s; applying it to the "
            "weights as stored there (%s)", adapter_dir, quantization(saved), base,
            quantization(found),
        )  # fmt: skip
    if fingerprint_differences(saved, found, with_quant=False):
        if not allow_other:
            raise refuse_other_base(lead, saved, found, ALLOW_FLAG)
        log.warning("%s; going on as %s asks", base_mismatch(lead, saved, found), ALLOW_FLAG)
    return base


def _base_directory(named: str, revision: str | None) -> Path:
    """The local directory of ``base_model_name_or_path``: a directory, or a Hub id's
    snapshot in the local Hub cache (nothing is downloaded)."""
    from veoptim.config.model_source import hub_snapshot, is_hub_id

    if Path(named).is_dir() or not is_hub_id(named):
        return Path(named)
    try:
        return hub_snapshot(named, revision or "", local_only=True)[0]
    except ConfigError as error:
        raise CheckpointError(str(error)) from error
