"""The task commands' ``--help``: every config key with its type, default and meaning.

Hydra's own ``--help`` lists only the config groups; a newcomer needs the keys. The keys,
types and help texts come from the task's config dataclass (``veoptim.config.reference``,
the walker behind docs/config.md); the defaults from the composed task config (or the
``--config-name`` recipe), so they are what a run without overrides would use.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml
from hydra import compose
from omegaconf import OmegaConf

from veoptim.config import register_schema
from veoptim.config.reference import config_keys, sections

from .compose import CONFIG_DIR, SearchPath

WIDTH = 100
#: Config dirs that are not groups a user picks on the command line.
NOT_GROUPS = {"hydra", "recipes"}
CONFIG_NAME_FLAGS = ("--config-name", "-cn")
CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def _flag_value(argv: list[str], flags: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in flags:
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return None


def config_name_of(argv: list[str], default: str) -> str:
    """The ``--config-name`` (or ``-cn``) given on the command line, else ``default``."""
    return _flag_value(argv, CONFIG_NAME_FLAGS) or default


def config_dir_of(argv: list[str]) -> str | None:
    """The ``--config-dir`` (or ``-cd``) given on the command line, else None."""
    return _flag_value(argv, CONFIG_DIR_FLAGS)


def _fmt(value: Any) -> str:
    """A value as one would type it as an override."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return "''" if value == "" else str(value)


def short_type(name: str) -> str:
    """``list[ParamGroupConfig]`` for ``list[veoptim.config.schema.ParamGroupConfig]``."""
    return re.sub(r"[\w.]+\.(\w+)", r"\1", name)


def _lookup(tree: dict, key: str, default: Any) -> Any:
    """``tree["a"]["b"]`` for ``a.b``; ``default`` where the composed config lacks it."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


def header_comment(path: Path) -> str:
    """The first paragraph of a YAML file's leading comment, as one line."""
    lines: list[str] = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if text.startswith("# @package"):
            continue
        if not text.startswith("#"):
            break
        text = text.lstrip("#").strip()
        if text:
            lines.append(text)
        elif lines:
            break
    return " ".join(lines)


def recipes_of(task: str) -> dict[str, str]:
    """The recipes of this task (those whose defaults list ``/<task>_schema``), described."""
    found = {}
    for path in sorted((CONFIG_DIR / "recipes").glob("*.yaml")):
        defaults = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
        if f"/{task}_schema" in defaults:
            first = header_comment(path).removeprefix("Recipe: ").split(". ")[0]
            found[path.stem] = first.rstrip(".")
    return found


def groups(choices: dict[str, Any]) -> list[str]:
    """``group  a, b (default), c`` for every config group directory."""
    out = []
    for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in NOT_GROUPS):
        options = sorted(p.stem for p in group.glob("*.yaml"))
        marked = [f"{o} (default)" if o == choices.get(group.name) else o for o in options]
        out.append(f"  {group.name:<10} {', '.join(marked)}")
    return out


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent,
        break_on_hyphens=False, break_long_words=False,
    )  # fmt: skip


def render_help(
    task: str, schema: type, prog: str, config_name: str, config_dir: str | None = None
) -> str:
    """The whole help text of ``prog`` (``veoptim-sft`` or ``python -m tasks.sft``), with
    the defaults of ``config_name`` (in ``config_dir``, a ``--config-dir``, when given)."""
    register_schema(task, schema)  # what the task's YAML composes over
    search = SearchPath(extra=str(Path(config_dir).resolve()) if config_dir else None)
    with search.initialized(task):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    values = OmegaConf.to_container(cfg, resolve=False)
    values.pop("hydra")
    pad = " " * len(f"usage: {prog}")
    out = [
        f"usage: {prog} [--config-name recipes/<recipe>] [group=option ...] [key=value ...]",
        f"{pad} -m key=a,b [...]   (a sweep: one run per value, in <run.dir>/0, /1, ...)",
        f"       torchrun --standalone --nproc_per_node N -m tasks.{task} [same arguments]",
        "",
        *_wrap(header_comment(CONFIG_DIR / f"{task}.yaml"), ""),
        "",
        f"Config groups (group=option; {CONFIG_DIR}/<group>/):",
        *groups(choices),
        "",
    ]
    recipes = recipes_of(task)
    if recipes:
        out.append("Recipes (--config-name recipes/<recipe>; add recipes/scale=cpu_smoke for a")
        out.append("scaled-down CPU run under torchrun --nproc_per_node 2):")
        for name, text in recipes.items():
            out += [f"  {name}", *_wrap(text, "      ")]
        out.append("")
    source = f"{config_name}.yaml" + ("" if config_name == task else " (--config-name)")
    out.append(f"Config keys (key=value; defaults of {source}):")
    for section, cls in sections(schema):
        out.append(f"  {section}:")
        for k in config_keys(cls, f"{section}."):
            value = _fmt(_lookup(values, k.key, k.default))
            out.append(f"    {k.key}: {short_type(k.type)} = {value}")
            out += _wrap(k.help, "        ")
    out += [
        "",
        "Mistakes:",
        *_wrap(
            "An unknown key (optim.lrr=1e-3), an unknown group option (optim=adamww) or a value "
            "of the wrong type (train.max_steps=many) stops the command before anything runs: "
            "one line naming the key and the closest known key (or the group's valid options, "
            "or the expected type), exit status 2; under torchrun every rank prints that line "
            "and exits before the process group starts. Invalid values (optim.lr=-1) are "
            "refused the same way when the job starts. --cfg job prints the composed config "
            "without validating its values (a config it prints may still be refused): to check "
            "a run without training it, with its data and model paths, tokenizer and dataset, "
            "add run.dry_run=true (it prints the plan: model, parameters, steps, batch sizes, "
            "world size, checkpoint and run dirs).",
            "  ",
        ),
        "",
        "Hydra's own options (--cfg job prints the composed config, --info, --config-dir, ...):",
        f"  {prog} --hydra-help",
    ]
    return "\n".join(out) + "\n"
