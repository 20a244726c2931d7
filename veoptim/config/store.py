"""Register task schemas with Hydra's ConfigStore and turn a composed DictConfig into dataclasses."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from veoptim.config.keys import check_known_keys
from veoptim.config.model_source import resolve_model_source
from veoptim.config.schema import TrainerConfig
from veoptim.config.validate import validate_config
from veoptim.errors import ConfigError


def schema_name(task: str) -> str:
    """The ConfigStore name a task's YAML lists first in its ``defaults`` (``sft_schema``)."""
    return f"{task}_schema"


def register_schema(task: str, schema: type[TrainerConfig]) -> None:
    """Make ``<task>_schema`` available to ``defaults`` lists (idempotent)."""
    ConfigStore.instance().store(name=schema_name(task), node=schema)


def to_config(cfg: DictConfig, *, resolve_model: bool = True) -> TrainerConfig:
    """Convert a config composed with a task schema to its validated dataclass (ConfigError).

    Keys the schema does not declare (``+optim.lrr=...``) are rejected first: the
    conversion would drop them silently. ``model.path`` is then resolved on this machine
    (a Hub id becomes its pinned snapshot, a missing directory is refused);
    ``resolve_model=False`` validates a config meant for another machine, such as a
    recipe whose model lives on the cluster.
    """
    check_known_keys(cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainerConfig):
        raise ConfigError(
            "the composed config has no task schema: its YAML must list a registered "
            f"<task>_schema first in its defaults (found {type(obj).__name__})."
        )
    validate_config(obj)
    if resolve_model:
        resolve_model_source(obj.model)  # a Hub id becomes its pinned snapshot directory
    return obj
