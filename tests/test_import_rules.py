"""Which package may import which: read every module's imports and check the house rules.

The rules (see docs/architecture.md): the library never imports the entry points or
callbacks; the checkpoint package knows only state components, never the trainer, a
specific component, an optimizer or a model; optimizers know nothing of files; data
knows nothing of models; the loop knows no task.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: package (dotted prefix) -> packages it must never import (dotted prefixes).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # (installed, tasks/ and callbacks/ are veoptim.tasks and veoptim.callbacks: setup.py)
    "veoptim": ("tasks", "callbacks", "veoptim.tasks", "veoptim.callbacks"),
    "veoptim.checkpoint": (
        "veoptim.trainer",
        "veoptim.state",
        "veoptim.objectives",
        "veoptim.optim",
        "veoptim.models",
        "veoptim.data",
        "veoptim.config",
        "veoptim.export",
    ),
    "veoptim.optim": ("veoptim.checkpoint", "veoptim.state", "veoptim.trainer", "veoptim.data"),
    "veoptim.data": ("veoptim.models", "veoptim.optim", "veoptim.checkpoint", "veoptim.trainer"),
    "veoptim.models": ("veoptim.checkpoint", "veoptim.trainer", "veoptim.optim", "veoptim.data"),
    "veoptim.distributed": ("veoptim.checkpoint", "veoptim.state", "veoptim.trainer"),
    "veoptim.config": (
        "veoptim.checkpoint",
        "veoptim.state",
        "veoptim.trainer",
        "veoptim.objectives",
        "veoptim.optim",
        "veoptim.models",
        "veoptim.data",
        "veoptim.distributed",
    ),
    "veoptim.state": ("veoptim.trainer", "veoptim.objectives"),
    "veoptim.export": ("veoptim.trainer", "veoptim.objectives", "veoptim.optim"),
    "veoptim.trainer": ("veoptim.objectives",),
    "veoptim.lora": ("veoptim.trainer", "veoptim.objectives", "veoptim.export", "veoptim.optim"),
    # The multi-LoRA slot runtime composes adapters, optimizers, checkpoints and exports;
    # it is a sibling of the Trainer, not built on it.
    "veoptim.lora.slots": ("veoptim.trainer", "veoptim.objectives"),
    # The training service drives the slots only through SlotTrainer: no checkpoint,
    # state or optimizer internals, and no single-model Trainer.
    "veoptim.service": (
        "veoptim.trainer",
        "veoptim.objectives",
        "veoptim.checkpoint",
        "veoptim.state",
        "veoptim.optim",
    ),
}
#: package -> subpackages its rule does not govern (they have their own rule above).
EXEMPT: dict[str, tuple[str, ...]] = {"veoptim.lora": ("veoptim.lora.slots",)}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an ``import`` / ``from ... import`` names (relative ones resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """'module imports X (forbidden for P)' for every import that breaks a rule."""
    out = []
    for imported in sorted(imported_modules(source, module, is_package)):
        for package, forbidden in FORBIDDEN.items():
            if not _within(module, package):
                continue
            if any(_within(module, sub) for sub in EXEMPT.get(package, ())):
                continue
            for prefix in forbidden:
                if _within(imported, prefix):
                    out.append(f"{module} imports {imported} (forbidden for {package})")
    return out


def test_the_library_keeps_the_import_rules():
    found = []
    for path in sorted((REPO / "veoptim").rglob("*.py")):
        found += violations(module_name(path), path.read_text(), path.name == "__init__.py")
    assert found == []


def test_the_rules_catch_a_forbidden_import():
    """Negative control: the checker is not vacuous."""
    assert violations("veoptim.checkpoint.extra", "from veoptim.trainer import Trainer\n")
    assert violations("veoptim.checkpoint.extra", "from ..state import MODEL\n")
    assert violations("veoptim.optim.extra", "import veoptim.checkpoint.publish\n")
    assert violations("veoptim.data.extra", "from veoptim.models import build_model\n")
    assert violations("veoptim.trainer.extra", "from veoptim.objectives import SFTConfig\n")
    assert violations("veoptim.models.extra", "def f():\n    import callbacks\n")
    assert violations("veoptim.models.extra", "from veoptim.callbacks import metrics\n")
    assert violations("veoptim.export.extra", "from veoptim.trainer import Trainer\n")
    assert not violations("veoptim.state.extra", "from veoptim.checkpoint import contents\n")
    assert not violations("tasks.extra", "from veoptim.trainer import Trainer\n")
    assert violations("veoptim.lora.extra", "from veoptim.optim import build_optimizer\n")
    assert not violations("veoptim.lora.slots.extra", "from veoptim.optim import build_optimizer\n")
    assert violations("veoptim.lora.slots.extra", "from veoptim.trainer import Trainer\n")
    assert violations("veoptim.service.extra", "from veoptim.checkpoint import publish\n")
    assert not violations("veoptim.service.extra", "from veoptim.lora.slots import SlotTrainer\n")
