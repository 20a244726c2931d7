"""Every config key of a config dataclass, with its type, default and help text.

One walker serves the generated reference (``scripts/gen_config_docs.py`` → docs/config.md)
and the task commands' ``--help``, so the two can never describe different keys.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from veoptim.config.schema import TrainerConfig


@dataclass(frozen=True)
class ConfigKey:
    """One overridable key: ``optim.lr``, its type name, dataclass default and help text."""

    key: str
    type: str
    default: Any
    help: str


def type_name(tp: object) -> str:
    """``int`` for plain classes, the full spelling for generics (``list[str]``)."""
    text = getattr(tp, "__name__", None) or str(tp)
    return str(tp) if "[" in str(tp) else text


def _default(f: dataclasses.Field) -> Any:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
        default = [dataclasses.asdict(d) for d in default]
    return default


def config_keys(cls: type, prefix: str = "") -> list[ConfigKey]:
    """The leaf keys of ``cls`` in declaration order; nested dataclasses become ``a.b`` keys."""
    keys: list[ConfigKey] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, key + ".")
        else:
            keys.append(ConfigKey(key, type_name(tp), _default(f), f.metadata.get("help", "")))
    return keys


def sections(cls: type) -> list[tuple[str, type]]:
    """The top-level sections of a task config (``run``, ``model``, ...) and their classes."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def task_sections(cls: type, shared: type = TrainerConfig) -> list[tuple[str, type]]:
    """The sections a task config adds or replaces relative to the config every task shares."""
    common = typing.get_type_hints(shared)
    return [(name, tp) for name, tp in sections(cls) if common.get(name) is not tp]
