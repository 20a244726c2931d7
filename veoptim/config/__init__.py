"""Structured configs (dataclasses), their Hydra registration and semantic validation."""

from veoptim.config.explicit import prefer_explicit
from veoptim.config.schema import TrainerConfig
from veoptim.config.store import register_schema, schema_name, to_config
from veoptim.config.validate import validate_config

__all__ = [
    "TrainerConfig",
    "prefer_explicit",
    "register_schema",
    "schema_name",
    "to_config",
    "validate_config",
]
