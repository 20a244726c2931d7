"""Package names imported on first use (PEP 562), so a light submodule stays light.

A package whose ``__init__`` re-exports heavy names (torch, FSDP, the trainer) writes::

    __getattr__, __dir__ = lazy_names(__name__, {"Trainer": "trainer", ...})

and importing one of its light submodules, or a light name, then loads none of them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``exports`` (name -> submodule)
    is imported from ``package.<submodule>`` on first access and cached in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
