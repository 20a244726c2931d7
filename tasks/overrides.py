"""Check a task command's overrides before Hydra runs them: one sentence per mistake.

Hydra reports a mistyped key (``optim.lrr=1e-3``), an unknown group option
(``optim=adamww``) or a value of the wrong type (``train.max_steps=many``) in 7-13 lines,
exits with status 1 and advises the ``+`` form, which would add the mistyped key.
``command_line_error`` composes the same config first, with the same overrides (in a
multirun, each value of each sweep), and turns what fails into one sentence naming the
key and the closest known key, or the group's valid options, or the expected type. The
task command prints it and exits with status 2 before Hydra starts, so under torchrun
every rank stops before any process group exists.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
from argparse import Namespace

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from veoptim.config.keys import check_known_keys, other_tools_hint, suggest_key
from veoptim.config.reference import config_keys
from veoptim.errors import ConfigError

from .compose import CONFIG_DIR
from .usage import short_type

#: Hydra flags after which nothing is composed to run (help texts, shell completion).
_NOTHING_RUNS = ("help", "hydra_help", "info", "shell_completion", "experimental_rerun")
#: At most this many compositions check a multirun's sweeps.
MAX_VARIANTS = 64


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


def _override_of(key: str, lines: list[str]) -> str:
    """The override (as typed) that sets ``key``."""
    for line in lines:
        name = line.split("=", 1)[0].lstrip("+~").split("@")[0]
        if name == key:
            return line
    return key


def _missing_option(error: MissingConfigException, lines: list[str], prog: str) -> str:
    group, _, option = (error.missing_cfg_file or "").rpartition("/")
    if not group or error.options is None:
        return f"the config does not compose: {_one_line(error)}"
    options = sorted(error.options)
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return (
        f"unknown option {option!r} of config group {group} ({_override_of(group, lines)}); "
        f"{hint}valid options: {', '.join(options)} ({prog} --help describes them)."
    )


def _override_error(
    error: ConfigCompositionException, schema: type, lines: list[str], prog: str
) -> str:
    cause = error.__cause__
    key = getattr(cause, "full_key", None)
    if not key:
        return f"the config does not compose: {_one_line(error)}"
    override = _override_of(key, lines)
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return (
            f"unknown config key {key} ({override}): {schema.__name__} declares no such key; "
            f"{suggest_key(key, schema)} ({prog} --help lists every key)"
        )
    if isinstance(cause, ValidationError):
        types = {k.key: short_type(k.type) for k in config_keys(schema)}
        reason = str(getattr(cause, "msg", cause)).strip().splitlines()[0].rstrip(".")
        value = override.split("=", 1)[1] if "=" in override else ""
        if key not in types:
            return f"invalid value {value!r} for {key} ({override}: {reason})."
        article = "an" if types[key][0] in "aeiou" else "a"
        return f"{key} must be {article} {types[key]}, not {value!r} ({override}: {reason})."
    return f"the config does not compose: {_one_line(error)} ({_one_line(cause)})"


def _compose_error(
    task: str, schema: type, config_name: str, lines: list[str], prog: str
) -> str | None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name=task):
        try:
            cfg = compose(config_name=config_name, overrides=lines)
        except MissingConfigException as error:
            return _missing_option(error, lines, prog)
        except ConfigCompositionException as error:
            return _override_error(error, schema, lines, prog)
        except (HydraException, OmegaConfBaseException) as error:
            return f"the config does not compose: {_one_line(error)}"
    try:
        check_known_keys(cfg)  # '+optim.lrr=...' composes; its value would be dropped
    except ConfigError as error:
        return str(error)
    return None


def command_line_error(task: str, schema: type, argv: list[str], prog: str) -> str | None:
    """The one-sentence error of a command line whose config does not compose (None: it does).

    Only what composition decides is checked here (keys, group options, types, ``+`` keys
    the schema lacks); the values' meaning is validated when the job starts
    (``veoptim.config.to_config``), and in full, without training, by ``run.dry_run=true``.
    """
    for arg in argv:  # another tool's flag: Hydra would print its usage and exit 2 unexplained
        habit = other_tools_hint(arg) if arg.startswith("--") else None
        if habit:
            return (
                f"{arg} is not an option of {prog}: settings are key=value overrides; "
                f"did you mean {habit}? ({prog} --help lists every key)"
            )
    args = _parse(argv)
    if args is None or any(getattr(args, flag, None) for flag in _NOTHING_RUNS):
        return None
    if args.config_dir or args.config_path:  # another search path: Hydra reports on its own
        return None
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
        variants = _variants(overrides, bool(args.multirun))
    except (OverrideParseException, HydraException, ValueError) as error:
        return f"cannot parse the overrides: {_one_line(error)}"
    for lines in variants:
        problem = _compose_error(task, schema, args.config_name or task, lines, prog)
        if problem:
            return problem
    return None
