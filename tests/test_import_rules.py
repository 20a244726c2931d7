"""Which package may import which: read every module's imports and check the house rules.

The rules (see docs/architecture.md): the library never imports the entry points or
callbacks; the checkpoint package knows only state components, never the trainer, a
specific component, an optimizer or a model; optimizers know nothing of files; data
knows nothing of models; the loop knows no task. The DCP storage under
``veoptim/checkpoint/storage/`` is entered only through its package's own functions (its
door); no two files of the library import each other, directly or round a circle; and no
two of its packages do, not even through imports under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
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
    "veoptim.export": ("veoptim.trainer", "veoptim.objectives", "veoptim.optim", "veoptim.slots"),
    "veoptim.trainer": ("veoptim.objectives", "veoptim.slots"),
    "veoptim.lora": (
        "veoptim.trainer",
        "veoptim.objectives",
        "veoptim.export",
        "veoptim.optim",
        "veoptim.slots",
    ),
    # The multi-LoRA slot runtime composes adapters, optimizers, checkpoints and exports;
    # it is a sibling of the Trainer, not built on it (and neither imports the other).
    "veoptim.slots": ("veoptim.trainer", "veoptim.objectives", "veoptim.service"),
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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from (relative ones resolved)."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = module.split(".")
    anchor = anchor if is_package else anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, base] if base else anchor)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module an ``import`` / ``from ... import`` names (relative ones resolved)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, module, is_package)
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
            for prefix in forbidden:
                if _within(imported, prefix):
                    out.append(f"{module} imports {imported} (forbidden for {package})")
    return out


#: A package -> the modules of the library that may import its modules (the rest import
#: only the package itself, its door; docs/architecture.md "One door per concern").
DOORS: dict[str, str] = {
    "veoptim.checkpoint.storage": "veoptim.checkpoint.storage",
    "veoptim.checkpoint": "veoptim.checkpoint",
    "veoptim.export": "veoptim.export",
    "veoptim.optim.kernels": "veoptim.optim.kernels",
    "veoptim.slots": "veoptim.slots",
}
#: A module of the standard library or a dependency -> the one library module that uses it.
ONE_USER: dict[str, str] = {"sqlite3": "veoptim.service.db"}


def door_violations(
    module: str, source: str, is_package: bool = False, modules: Collection[str] = ()
) -> list[str]:
    """'module imports X behind the door of P' for every import of a module of a door's
    package (``modules``: the library's; a name imported from the package itself is
    through the door) from outside that package, and every import of a module with one
    user by another."""
    out = []
    for imported in sorted(imported_modules(source, module, is_package)):
        for package, inside in DOORS.items():
            behind = _within(imported, package) and imported != package and imported in modules
            if behind and not _within(module, inside):
                out.append(f"{module} imports {imported} (enter {package} through its door)")
        for name, user in ONE_USER.items():
            if _within(imported, name) and module != user:
                out.append(f"{module} imports {imported} (only {user} does)")
    return out


def library_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted((REPO / "veoptim").rglob("*.py"))}


def runtime_imports(module: str, path: Path, modules: Collection[str],
                    type_checking: bool = False) -> set[str]:  # fmt: skip
    """The library modules ``module`` imports when it runs (also inside functions; not
    under ``if TYPE_CHECKING:``, which never runs, unless ``type_checking``). ``from package
    import submodule`` is an edge to the submodule only: its package was imported before
    the importing module."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if type_checking:
            break
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
            continue
        base = from_base(node, module, path.name == "__init__.py")
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules else base)
    return (found & set(modules)) - {module}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other round a circle (strongly connected
    components of more than one module)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_no_library_files_import_each_other_round_a_circle():
    modules = library_modules()
    graph = {name: runtime_imports(name, path, modules) for name, path in modules.items()}
    assert sum(len(edges) for edges in graph.values()) > 100  # the graph is really read
    assert circles(graph) == []


def package_of(module: str) -> str:
    """The package of the library a module belongs to: ``veoptim.lora.state`` ->
    ``veoptim.lora``; a shared leaf (``veoptim.errors``) is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (from a module graph)."""
    out: dict[str, set[str]] = {}
    for module, imported in graph.items():
        package = package_of(module)
        out.setdefault(package, set()).update({package_of(m) for m in imported} - {package})
    return out


def test_no_two_packages_import_each_other_not_even_for_type_checking():
    """The library's packages can be read in an order where each needs only those before
    it: no circle of packages, not even one closed by an import under ``TYPE_CHECKING``
    or inside a function."""
    modules = library_modules()
    graph = {n: runtime_imports(n, p, modules, type_checking=True) for n, p in modules.items()}
    packages = package_graph(graph)
    assert len(packages) > 15 and "veoptim.slots" in packages  # the graph is really read
    assert {"veoptim.lora", "veoptim.state", "veoptim.optim"} <= packages["veoptim.slots"]
    assert circles(packages) == []


def test_the_package_check_finds_a_circle_closed_for_type_checking(tmp_path):
    """Negative control: two packages whose modules import each other's only round an
    import under ``if TYPE_CHECKING:`` form a circle of packages, though no module circle
    (and none without the type-checking import)."""
    sources = {
        "veoptim.alpha.x": "from veoptim.beta.y import f\n",
        "veoptim.alpha.z": "G = 1\n",
        "veoptim.beta.y": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from veoptim.alpha.z import G\n"
        ),
    }
    paths = {}
    for module, text in sources.items():
        paths[module] = tmp_path / f"{module}.py"
        paths[module].write_text(text)
    graph = {n: runtime_imports(n, p, sources, type_checking=True) for n, p in paths.items()}
    assert circles(graph) == []
    assert circles(package_graph(graph)) == [["veoptim.alpha", "veoptim.beta"]]
    at_runtime = {n: runtime_imports(n, p, sources) for n, p in paths.items()}
    assert circles(package_graph(at_runtime)) == []


def test_the_service_package_has_no_import_circle_not_even_for_type_checking():
    """The training service's layers (HTTP -> engine -> backend -> slots, the data layer
    beneath them) only ever import downwards: no circle closed by ``TYPE_CHECKING``."""
    modules = {n: p for n, p in library_modules().items() if _within(n, "veoptim.service")}
    graph = {n: runtime_imports(n, p, modules, type_checking=True) for n, p in modules.items()}
    assert sum(len(edges) for edges in graph.values()) > 50  # the graph is really read
    assert circles(graph) == []


def test_a_type_checking_import_counts_for_the_service(tmp_path):
    """Negative control: an import under ``if TYPE_CHECKING:`` is an edge for the service's
    check, and none for the library-wide one."""
    source = tmp_path / "a.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n")
    assert runtime_imports("a", source, {"a", "b"}, type_checking=True) == {"b"}
    assert runtime_imports("a", source, {"a", "b"}) == set()


def test_the_circle_check_finds_a_circle():
    """Negative control: a three-module circle (and only it) is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_each_concern_is_entered_only_through_its_door():
    modules = library_modules()
    found = []
    for name, path in modules.items():
        found += door_violations(name, path.read_text(), path.name == "__init__.py", modules)
    assert found == []
    # negative controls: a module behind a door, from outside; the door itself; inside
    for outside, imported in [
        ("veoptim.export.extra", "veoptim.checkpoint.storage.raw_reader"),
        ("veoptim.export.extra", "veoptim.checkpoint.checkpointer"),
        ("veoptim.trainer.extra", "veoptim.checkpoint.storage"),
        ("veoptim.service.extra", "veoptim.slots.tokens"),
        ("veoptim.optim.extra", "veoptim.optim.kernels.eager"),
        ("tasks.extra", "veoptim.export.registry"),
    ]:
        assert door_violations(outside, f"from {imported} import x\n", modules=modules), imported
    assert door_violations("veoptim.service.extra", "import sqlite3\n", modules=modules)
    assert not door_violations("veoptim.service.db", "import sqlite3\n", modules=modules)
    assert not door_violations(
        "veoptim.export.extra", "from veoptim.checkpoint import Checkpointer\n", modules=modules
    )
    assert not door_violations(
        "veoptim.checkpoint.extra", "from veoptim.checkpoint.storage import x\n", modules=modules
    )
    assert not door_violations(
        "veoptim.checkpoint.storage.extra",
        "from veoptim.checkpoint.storage.raw_format import x\n",
        modules=modules,
    )


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
    assert not violations("veoptim.slots.extra", "from veoptim.optim import build_optimizer\n")
    assert not violations("veoptim.slots.extra", "from veoptim.export import publish_adapter\n")
    assert violations("veoptim.slots.extra", "from veoptim.trainer import Trainer\n")
    assert violations("veoptim.lora.extra", "from veoptim.slots import SlotTrainer\n")
    assert violations("veoptim.export.extra", "from veoptim.slots.routing import SlotParams\n")
    assert violations("veoptim.service.extra", "from veoptim.checkpoint import publish\n")
    assert not violations("veoptim.service.extra", "from veoptim.slots import SlotTrainer\n")
