"""Check a task command's config before Hydra runs it: one sentence per mistake.

Hydra reports a mistyped key (``optim.lrr=1e-3``), an unknown group option
(``optim=adamww``) or a value of the wrong type (``train.max_steps=many``) in 7-13 lines,
exits with status 1 and advises the ``+`` form, which would add the mistyped key; a mistake
in a config file of the user's own (``--config-dir``) gets the same lines without the file
or its line, and a YAML syntax error a traceback. ``check_command_line`` composes the same
config first, on the same search path, with the same overrides (in a multirun, each value
of each sweep), and turns what fails into one sentence naming the key and where it was set
(the override, or the file and line), with the closest known key, the group's valid
options, or the expected type. The task command prints it and exits with status 2 before
Hydra starts, so under torchrun every rank stops before any process group exists.

The same composition tells which of Hydra's own settings the primary config leaves at
Hydra's defaults: its output dirs (``outputs/<date>/<time>``) and its log format. The task
command gives them on the command line, so that any primary config writes into its
``run.dir`` and logs in veoptim's format, whether or not it has the ``hydra:`` block and the
logging overrides of ``configs/sft.yaml``.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hydra import compose
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from veoptim.config.keys import check_known_keys, other_tools_hint, suggest_key
from veoptim.config.reference import config_keys
from veoptim.errors import ConfigError
from veoptim.rundir.lock import run_dir_problem

from .compose import SearchPath
from .config_files import (
    config_file,
    defaults_place,
    failed_config,
    key_place,
    shown,
    syntax_place,
)
from .usage import short_type

#: Hydra flags after which nothing is composed to run (help texts, shell completion).
_NOTHING_RUNS = ("help", "hydra_help", "info", "shell_completion", "experimental_rerun")
#: At most this many compositions check a multirun's sweeps.
MAX_VARIANTS = 64
#: Hydra's output dirs, which follow ``run.dir`` unless the command line sets them.
RUN_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")
#: Hydra's logging groups: veoptim's line format where the primary config keeps Hydra's.
LOGGING_GROUPS = ("hydra/job_logging", "hydra/hydra_logging")
LOG_FORMAT = "veoptim"
HYDRA_DEFAULT = "default"


@dataclass(frozen=True)
class Checked:
    """What the check of a command line found: its one-sentence problem (None: none), and
    the overrides of Hydra's settings that the primary config leaves at Hydra's defaults."""

    problem: str | None = None
    hydra_overrides: list[str] = field(default_factory=list)


def rank_prefix(env: os._Environ | dict = os.environ) -> str:
    """``[rank1] `` under a launcher with several ranks (the log lines' prefix), else ``''``."""
    try:
        world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    except ValueError:
        return ""
    return f"[rank{rank}] " if world > 1 else ""


def _parse(argv: list[str]) -> Namespace | None:
    """Hydra's own parse of the command line (None: Hydra will report the usage error)."""
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return get_args_parser().parse_args(argv)
    except SystemExit:
        return None


def _one_line(error: BaseException) -> str:
    """Hydra's message as one line (without its config search path)."""
    text = str(error).split("Config search path:")[0]
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _variants(overrides: list[Override], multirun: bool) -> list[list[str]]:
    """The override lists to compose: each sweep value once, the other sweeps at their first."""
    lines = [o.input_line for o in overrides]
    sweeps = [i for i, o in enumerate(overrides) if o.is_sweep_override()] if multirun else []
    if not sweeps:
        return [lines]
    values = {i: list(overrides[i].sweep_string_iterator()) for i in sweeps}
    first = [
        f"{o.get_key_element()}={values[i][0]}" if i in values else lines[i]
        for i, o in enumerate(overrides)
    ]
    out = []
    for i in sweeps:
        for value in values[i]:
            out.append([*first[:i], f"{overrides[i].get_key_element()}={value}", *first[i + 1 :]])
    return out[:MAX_VARIANTS]


def _override_of(key: str, lines: list[str]) -> str | None:
    """The override (as typed) that sets ``key`` (None: no override does)."""
    for line in lines:
        name = line.split("=", 1)[0].lstrip("+~").split("@")[0]
        if name == key:
            return line
    return None


def _cause(error: ConfigCompositionException) -> BaseException | None:
    """OmegaConf's error behind Hydra's (raised ``from`` it for an override, during its
    handling for a config file)."""
    return error.__cause__ or error.__context__


def _file_of(error: Exception, search: SearchPath) -> Path | None:
    """The config file whose loading raised Hydra's ``error`` (``In '<config>': ...``)."""
    config = failed_config(str(error))
    return config_file(config, search.dirs()) if config else None


def _no_primary(name: str, search: SearchPath) -> str:
    """--config-name names no config in the search path: the closest that exist."""
    names = sorted(
        str(p.relative_to(d).with_suffix(""))
        for d in search.dirs()
        for p in d.rglob("*.yaml")
        if p.relative_to(d).parts[0] != "hydra"
    )
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    where = ", ".join(shown(d) for d in search.dirs())
    return f"--config-name {name}: there is no {name}.yaml in {where}{hint}"


def _missing_option(
    error: MissingConfigException, lines: list[str], prog: str, search: SearchPath
) -> str:
    group, _, option = (error.missing_cfg_file or "").rpartition("/")
    if error.options is None and error.missing_cfg_file:
        return _no_primary(error.missing_cfg_file, search)
    if not group or error.options is None:
        return f"the config does not compose: {_one_line(error)}"
    options = sorted(error.options)
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    where = _override_of(group, lines)
    if where is None:  # a defaults list of a config file chose it
        file = _file_of(error, search)
        place = defaults_place(file, group, option) if file else None
        where = str(place) if place else shown(file) if file else "its defaults list"
    return (
        f"unknown option {option!r} of config group {group} ({where}); "
        f"{hint}valid options: {', '.join(options)} ({prog} --help describes them)."
    )


def _where_set(
    error: ConfigCompositionException, key: str, lines: list[str], search: SearchPath
) -> tuple[str, str]:
    """Where ``key`` got its value, and the value as written: the override, or the file and
    line of the config that set it."""
    override = _override_of(key, lines)
    if override is not None:
        return override, override.split("=", 1)[1] if "=" in override else ""
    file = _file_of(error, search)
    found = key_place(file, key) if file else None
    if found is None:
        return (shown(file) if file else "the config"), ""
    place, value = found
    return str(place), value or ""


def _override_error(
    error: ConfigCompositionException, schema: type, lines: list[str], prog: str,
    search: SearchPath,
) -> str:  # fmt: skip
    cause = _cause(error)
    key = getattr(cause, "full_key", None)
    if not key:
        return f"the config does not compose: {_one_line(error)}"
    where, value = _where_set(error, key, lines, search)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return (
            f"unknown config key {key} ({where}): {schema.__name__} declares no such key; "
            f"{suggest_key(key, schema)} ({prog} --help lists every key)"
        )
    if isinstance(cause, ValidationError):
        types = {k.key: short_type(k.type) for k in config_keys(schema)}
        reason = str(getattr(cause, "msg", cause)).strip().splitlines()[0].rstrip(".")
        sep = ": " if "=" in where else "; "  # an override, or a file's line
        if key not in types:
            return f"invalid value {value!r} for {key} ({where}{sep}{reason})."
        article = "an" if types[key][0] in "aeiou" else "a"
        return f"{key} must be {article} {types[key]}, not {value!r} ({where}{sep}{reason})."
    return f"the config does not compose: {_one_line(error)} ({_one_line(cause)})"


def _syntax_error(error: yaml.YAMLError) -> str:
    """A config file that is not YAML: the file, the line and the parser's reason."""
    place = syntax_place(error) if isinstance(error, yaml.MarkedYAMLError) else None
    if place is None:
        return f"a config file is not valid YAML: {_one_line(error)}"
    reason = error.problem or "not valid YAML"
    context = ""
    if error.context and error.context_mark is not None:
        context = f", {error.context} at line {error.context_mark.line + 1}"
    return f"config file {shown(place.file)} is not valid YAML: {reason}{context} ({place})."


def _no_schema(task: str, config_name: str, search: SearchPath) -> str:
    file = config_file(config_name, search.dirs())
    named = f"{shown(file)}" if file else f"config {config_name!r}"
    return (
        f"{named} composes no task schema: its defaults list neither {task}_schema nor a task "
        f"config such as {task}; start its defaults with '- {task}_schema' (and the groups) or "
        f"'- {task}' (docs/config.md, 'Your own config files')."
    )


def _has_schema(task: str, config_name: str, search: SearchPath) -> bool:
    """Whether ``config_name`` alone composes over a task schema (a dataclass)."""
    with search.initialized(task):
        try:
            cfg = compose(config_name=config_name)
        except (HydraException, OmegaConfBaseException, yaml.YAMLError):
            return True  # another problem: reported as it is
    return OmegaConf.get_type(cfg) not in (dict, None)


def _hydra_defaults(hydra: DictConfig, given: set[str]) -> list[str]:
    """Overrides for what the primary config leaves to Hydra: output dirs in ``run.dir``,
    veoptim's log format (what the command line sets stays)."""
    out = [f"{key}=${{run.dir}}" for key in RUN_DIR_KEYS if key not in given]
    choices = hydra.runtime.choices
    out += [
        f"{group}={LOG_FORMAT}"
        for group in LOGGING_GROUPS
        if group not in given and choices.get(group) == HYDRA_DEFAULT
    ]
    return out


def _compose(
    task: str, schema: type, search: SearchPath, config_name: str, lines: list[str], prog: str
) -> tuple[str | None, DictConfig | None]:
    """(the problem, None), or (None, the composed Hydra config)."""
    unknown_key: ConfigCompositionException | None = None
    with search.initialized(task):
        try:
            cfg = compose(config_name=config_name, overrides=lines, return_hydra_config=True)
        except MissingConfigException as error:
            return _missing_option(error, lines, prog, search), None
        except ConfigCompositionException as error:
            if not isinstance(_cause(error), (ConfigKeyError, ConfigAttributeError)):
                return _override_error(error, schema, lines, prog, search), None
            unknown_key = error
        except yaml.YAMLError as error:
            return _syntax_error(error), None
        except (HydraException, OmegaConfBaseException) as error:
            return f"the config does not compose: {_one_line(error)}", None
    if unknown_key is not None:  # or a config without the schema, where every key is unknown
        if not _has_schema(task, config_name, search):
            return _no_schema(task, config_name, search), None
        return _override_error(unknown_key, schema, lines, prog, search), None
    hydra = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    if OmegaConf.get_type(cfg) in (dict, None):
        return _no_schema(task, config_name, search), None
    try:
        check_known_keys(cfg)  # '+optim.lrr=...' composes; its value would be dropped
    except ConfigError as error:
        return str(error), None
    problem = run_dir_problem(cfg.run.dir) if "run" in cfg and "dir" in cfg.run else None
    return problem, None if problem else hydra


def check_command_line(task: str, schema: type, argv: list[str], prog: str) -> Checked:
    """The one-sentence problem of a command line whose config does not compose, or the
    overrides of Hydra's settings to run it with (see the module docstring).

    Only what composition decides is checked here (keys, group options, types, ``+`` keys
    the schema lacks, YAML syntax); the values' meaning is validated when the job starts
    (``veoptim.config.to_config``), and in full, without training, by ``run.dry_run=true``.
    """
    for arg in argv:  # another tool's flag: Hydra would print its usage and exit 2 unexplained
        habit = other_tools_hint(arg) if arg.startswith("--") else None
        if habit:
            return Checked(
                f"{arg} is not an option of {prog}: settings are key=value overrides; "
                f"did you mean {habit}? ({prog} --help lists every key)"
            )
    args = _parse(argv)
    if args is None or any(getattr(args, flag, None) for flag in _NOTHING_RUNS):
        return Checked()
    if args.config_dir and not os.path.isdir(args.config_dir):
        return Checked(f"--config-dir {args.config_dir} is not a directory (expected the "
                       "directory of your config files).")  # fmt: skip
    search = SearchPath.of_command(f"{__package__}.{task}", args.config_dir, args.config_path)
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
        variants = _variants(overrides, bool(args.multirun))
    except (OverrideParseException, HydraException, ValueError) as error:
        return Checked(f"cannot parse the overrides: {_one_line(error)}")
    given = {o.get_key_element().lstrip("+~") for o in overrides}
    hydra_overrides: list[str] | None = None
    for lines in variants:
        problem, hydra = _compose(task, schema, search, args.config_name or task, lines, prog)
        if problem:
            return Checked(problem)
        if hydra_overrides is None and hydra is not None:
            hydra_overrides = _hydra_defaults(hydra, given)
    return Checked(None, hydra_overrides or [])
