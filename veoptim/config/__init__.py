"""Structured configs (dataclasses), their Hydra registration and semantic validation."""

from veoptim.config.schema import SFTConfig
from veoptim.config.store import SFT_SCHEMA_NAME, register_configs, to_sft_config
from veoptim.config.validate import validate_config

__all__ = ["SFT_SCHEMA_NAME", "SFTConfig", "register_configs", "to_sft_config", "validate_config"]
