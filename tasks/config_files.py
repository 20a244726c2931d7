"""Where in a config file a mistake is: the file Hydra loaded, the line of a key or of a
defaults entry, the position of a YAML syntax error.

Hydra names the config (``In 'optim/mine': ...``) and the key (``train.max_stepz``) but no
file or line; a mistake in a user's own config file (``--config-dir``) is found by the same
search Hydra did, in the search path's directories in order, and the key is looked up in the
file's YAML nodes, which keep their line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

#: ``In 'optim/mine': ...``: the config whose loading failed, as Hydra reports it.
_IN_CONFIG = re.compile(r"^In '([^']+)'")
_INDEX = re.compile(r"\[(\d+)\]")


@dataclass(frozen=True)
class Place:
    """A line of a config file, for an error message: ``cfg/mine.yaml:10: max_stepz: 3``."""

    file: Path
    line: int  # 1-based
    text: str

    def __str__(self) -> str:
        return f"{shown(self.file)}:{self.line}: {self.text}"


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def failed_config(message: str) -> str | None:
    """The config path of Hydra's ``In '<config>': ...`` message (None: not named)."""
    found = _IN_CONFIG.match(message)
    return found.group(1) if found else None


def config_file(config: str, dirs: list[Path]) -> Path | None:
    """The file Hydra loads for ``config`` (``optim/mine``): the first of ``dirs`` (in
    search-path order) that has ``<config>.yaml``."""
    for directory in dirs:
        path = directory / f"{config}.yaml"
        if path.is_file():
            return path
    return None


def _line(file: Path, node: yaml.Node) -> Place:
    number = node.start_mark.line
    text = file.read_text().splitlines()[number].strip()
    return Place(file, number + 1, text)


def _root(file: Path) -> yaml.Node | None:
    try:
        return yaml.compose(file.read_text())
    except yaml.YAMLError:
        return None


def _child(node: yaml.Node, part: str) -> tuple[yaml.Node, yaml.Node] | None:
    """(key node, value node) of the key ``part`` of a mapping, or (item, item) of the
    item ``[n]`` of a sequence."""
    if isinstance(node, yaml.SequenceNode):
        index = _INDEX.fullmatch(part)
        if index and int(index.group(1)) < len(node.value):
            item = node.value[int(index.group(1))]
            return item, item
        return None
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == part:
                return key, value
    return None


def _parts(key: str) -> list[str]:
    """``optim.param_groups[0].lr`` -> ``["optim", "param_groups", "[0]", "lr"]``."""
    return [p for p in re.split(r"\.|(?=\[)", key) if p]


def _find(root: yaml.Node, parts: list[str]) -> tuple[yaml.Node, yaml.Node] | None:
    """(key node, value node) of the path ``parts`` below ``root``."""
    found: tuple[yaml.Node, yaml.Node] | None = None
    node = root
    for part in parts:
        found = _child(node, part)
        if found is None:
            return None
        node = found[1]
    return found


def key_place(file: Path, key: str) -> tuple[Place, str | None] | None:
    """Where ``file`` sets ``key`` (a dotted key of the composed config) and the value written
    there (None for a mapping or list); None when the file does not set it.

    A group file sets its keys below its package (``optim/mine.yaml``'s ``lrr`` is
    ``optim.lrr``), so the longest tail of the key's path that the file holds is the match.
    """
    root = _root(file)
    if root is None:
        return None
    parts = _parts(key)
    for start in range(len(parts)):
        found = _find(root, parts[start:])
        if found is not None:
            key_node, value_node = found
            value = value_node.value if isinstance(value_node, yaml.ScalarNode) else None
            return _line(file, key_node), value
    return None


def defaults_place(file: Path, group: str, option: str) -> Place | None:
    """The entry of ``file``'s defaults list that selects ``option`` of ``group``
    (``- optim: adamww``, ``- /optim: adamww``, ``- override /optim: adamww``)."""
    root = _root(file)
    found = _find(root, ["defaults"]) if root is not None else None
    if found is None or not isinstance(found[1], yaml.SequenceNode):
        return None
    for item in found[1].value:
        if not isinstance(item, yaml.MappingNode):
            continue
        for key, value in item.value:
            name = key.value.removeprefix("override").strip().lstrip("/").split("@")[0]
            if name == group and getattr(value, "value", None) == option:
                return _line(file, key)
    return None


def syntax_place(error: yaml.MarkedYAMLError) -> Place | None:
    """Where the YAML ``error`` is: the problem's line, or the context's (where the
    unfinished construct began) when the problem is the end of the file."""
    for mark in (error.problem_mark, error.context_mark):
        if mark is None or not mark.name or not Path(mark.name).is_file():
            continue
        lines = Path(mark.name).read_text().splitlines()
        if mark.line < len(lines) and lines[mark.line].strip():
            return Place(Path(mark.name), mark.line + 1, lines[mark.line].strip())
    return None
