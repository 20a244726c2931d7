"""Reject config keys the schema does not know.

Hydra's ``+key=value`` adds a key even to a structured config (it opens the struct
flag for the override), and ``OmegaConf.to_object`` then drops the key silently: a
typo such as ``+optim.lrr=1e-3`` (Hydra itself suggests the ``+``) would run a whole
job at the default learning rate. So every key of the composed config is compared
with the fields of its schema dataclass before conversion.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from veoptim.errors import ConfigError

_INDEX = re.compile(r"\[\d+\]")

_FP16 = "model.dtype=fp16 parallel.param_dtype=fp16 with optim=master_fp32_adamw (fp16 training)"
_NF4 = "model.quant=nf4 with lora.enabled=true (a 4-bit NF4 base: QLoRA)"
_TEMPLATE = "data.chat_template=<chatml|qwen2|llama3|file.jinja>"
#: What other tools' users type (transformers, PEFT, TRL, LLaMA-Factory, axolotl, vLLM flags),
#: by name with dashes as underscores, and veoptim's setting that does it.
OTHER_TOOLS: dict[str, str] = {
    "load_in_4bit": _NF4,
    "bnb_4bit_quant_type": _NF4,
    "quantization": _NF4,
    "quantization_bit": _NF4,
    "quantize": _NF4,
    "qlora": _NF4,
    "load_in_8bit": "model.quant=nf4 with lora.enabled=true (veoptim stores a frozen base in "
    "4-bit NF4 only)",
    "fp16": _FP16,
    "half": _FP16,
    "bf16": "model.dtype=bf16",
    "template": _TEMPLATE,
    "prompt_template": _TEMPLATE,
}


def other_tools_hint(name: str) -> str | None:
    """veoptim's setting for another tool's key or flag ``name`` (``--load-in-4bit``,
    ``load_in_4bit``), or None."""
    return OTHER_TOOLS.get(name.lstrip("-+~").split("=", 1)[0].rpartition(".")[2].replace("-", "_"))


def _child(node: DictConfig | ListConfig, key: str | int) -> object:
    """The child node, unresolved (interpolations and ``???`` are not evaluated)."""
    return node._get_node(key)  # noqa: SLF001 - public accessors resolve values


def unknown_keys(node: DictConfig | ListConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """``(dotted key, known keys at its level)`` for every key no schema dataclass declares."""
    found: list[tuple[str, list[str]]] = []
    if isinstance(node, ListConfig):
        for i in range(len(node)):
            child = _child(node, i)
            if isinstance(child, (DictConfig, ListConfig)):
                found += unknown_keys(child, f"{prefix}[{i}]")
        return found
    schema = OmegaConf.get_type(node)
    known = [f.name for f in fields(schema)] if schema and is_dataclass(schema) else None
    for key in node.keys():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if known is not None and key not in known:
            found.append((dotted, known))
            continue
        child = _child(node, key)
        if isinstance(child, (DictConfig, ListConfig)):
            found += unknown_keys(child, dotted)
    return found


def _all_keys(node: DictConfig | ListConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares (for suggestions across sections)."""
    keys: list[str] = []
    if not isinstance(node, DictConfig):
        return keys
    for key in node.keys():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        keys.append(dotted)
        child = _child(node, key)
        if isinstance(child, DictConfig):
            keys += _all_keys(child, dotted)
    return keys


def _suggestion(key: str, known: list[str], every_key: list[str]) -> str:
    """' (did you mean optim.lr?)' for the closest known key, or the keys at that level."""
    parent, _, leaf = _INDEX.sub("", key).rpartition(".")
    prefix = f"{parent}." if parent else ""
    habit = other_tools_hint(leaf)
    if habit and leaf not in known:
        return f"did you mean {habit}?"
    named = [k for k in known if leaf in k.split("_") and k != leaf]  # data.path: *_path
    if named:
        names = [prefix + k for k in named]
        listed = " or ".join(names) if len(names) < 3 else "one of " + ", ".join(names)
        return f"did you mean {listed}?"
    leaves = {k.rpartition(".")[2]: k for k in every_key}
    if leaf in leaves and leaf not in known:  # the right name in another section (+lr=...)
        return f"did you mean {leaves[leaf]}?"
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    if close:
        return f"did you mean {leaves[close[0]]}?"
    return f"known keys{' of ' + parent if parent else ''}: {', '.join(known)}."


def check_known_keys(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` naming every key of ``cfg`` that its schema does not declare."""
    unknown = unknown_keys(cfg)
    if not unknown:
        return
    names = [key for key, _ in unknown]
    every_key = [
        k for k in _all_keys(cfg) if not any(k == n or k.startswith(f"{n}.") for n in names)
    ]
    hints = [_suggestion(key, known, every_key) for key, known in unknown]
    pairs = zip(names, hints, strict=True)
    details = hints[0] if len(hints) == 1 else "; ".join(f"{n}: {h}" for n, h in pairs)
    schema = getattr(OmegaConf.get_type(cfg), "__name__", "the schema")
    raise ConfigError(
        f"unknown config key{'s' if len(names) > 1 else ''} {', '.join(names)}: {schema} "
        f"declares no such key (a '+' override adds it anyway, and its value would be "
        f"silently ignored); {details}"
    )


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key a config dataclass declares, sections included (``optim``, ``optim.lr``)."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        dotted = f"{prefix}{f.name}"
        keys.append(dotted)
        if is_dataclass(hints[f.name]):
            keys += schema_keys(hints[f.name], f"{dotted}.")
    return keys


def suggest_key(key: str, schema: type) -> str:
    """``did you mean optim.lr?`` for an unknown ``optim.lrr`` of ``schema`` (or the known keys)."""
    parent = _INDEX.sub("", key).rpartition(".")[0]
    cls: type | None = schema
    for part in parent.split(".") if parent else []:
        tp = typing.get_type_hints(cls).get(part) if cls else None
        cls = tp if isinstance(tp, type) and is_dataclass(tp) else None
    known = [f.name for f in fields(cls)] if cls else []
    return _suggestion(key, known, [k for k in schema_keys(schema) if k != key])
