"""Keys that set one thing two ways: the one given on the command line wins over a preset's.

The scheduler presets (``configs/scheduler/*.yaml``) set ``warmup_steps: 10``;
``scheduler.warmup_ratio=0.03`` given alone on the command line must mean "warm up for 3 %
of the run", not "warm up two ways" (an error). :func:`prefer_explicit` applies that to a
composed config: where the overrides give exactly one key of an :data:`ALTERNATIVES` group,
the group's other keys are set to the value that leaves them unused. Both given explicitly
stay as given, and validation (``validate.py``) refuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

#: Groups of keys that set the same thing, each with the value that leaves it unused.
ALTERNATIVES: tuple[tuple[tuple[str, object], ...], ...] = (
    (("scheduler.warmup_steps", 0), ("scheduler.warmup_ratio", 0.0)),
)


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys that ``overrides`` (Hydra's syntax: ``key=v``, ``+key=v``, ``~key``) set."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {override.key_or_group for override in parsed}


def prefer_explicit(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """In ``cfg`` (composed with ``overrides``), unset the presets' alternatives of each key
    the overrides give alone (see the module docstring)."""
    given = override_keys(overrides)
    for group in ALTERNATIVES:
        if sum(key in given for key, _ in group) != 1:
            continue
        for key, unused in group:
            if key not in given and OmegaConf.select(cfg, key) is not None:
                OmegaConf.update(cfg, key, unused)
