"""Register the structured schemas with Hydra's ConfigStore and turn a DictConfig into dataclasses."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from veoptim.config.schema import SFTConfig
from veoptim.config.validate import validate_config

SFT_SCHEMA_NAME = "sft_schema"


def register_configs() -> None:
    """Make ``sft_schema`` available to ``defaults`` lists (idempotent)."""
    ConfigStore.instance().store(name=SFT_SCHEMA_NAME, node=SFTConfig)


def to_sft_config(cfg: DictConfig) -> SFTConfig:
    """Convert a composed Hydra config to a validated ``SFTConfig`` (raises ConfigError)."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, SFTConfig):
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SFTConfig), cfg))
    validate_config(obj)
    return obj
