"""Config composition, schema validation and the generated reference."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from scripts.gen_config_docs import render
from tests.conftest import REPO, compose_sft
from veoptim.config import to_config
from veoptim.errors import ConfigError
from veoptim.objectives import SFTConfig


def test_default_config_composes_to_typed_dataclass():
    cfg = to_config(compose_sft())
    assert isinstance(cfg, SFTConfig)
    assert cfg.model.arch == "qwen2" and cfg.optim.name == "adamw"
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


def test_group_selection_and_overrides():
    cfg = to_config(compose_sft(["model=tiny_moe", "optim.lr=1e-4", "train.seed=7"]))
    assert cfg.model.arch == "qwen3_moe" and cfg.model.num_experts == 4
    assert cfg.optim.lr == 1e-4 and cfg.train.seed == 7


def test_unknown_key_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as info:
        compose_sft(["optim.lrr=1e-4"])
    assert "lrr" in str(info.value.__cause__ or info.value)


def test_wrong_type_fails_naming_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose_sft(["train.max_steps=many"])
    assert "max_steps" in str(info.value.__cause__ or info.value)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.dtype=fp16", "model.dtype"),
        ("run.device=tpu", "run.device"),
        ("train.micro_batch_size=3", "train.global_batch_size"),
        ("train.stop_at_step=10000", "train.stop_at_step"),
        ("scheduler.name=step", "scheduler.name"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("train.max_steps=-1", "train.max_steps"),
    ],
)
def test_semantic_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_config(compose_sft([override]))


def test_config_reference_is_in_sync_with_dataclasses():
    committed = (REPO / "docs" / "config.md").read_text()
    assert committed == render(), "docs/config.md is stale: run `make docs`"


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_default_batch_sizes_work_on_the_documented_rank_counts(ranks):
    """README and docs launch 1, 2 and 4 ranks with the default batch sizes."""
    from veoptim.data import GlobalBatchSampler

    train = to_config(compose_sft()).train
    sampler = GlobalBatchSampler(3000, train.global_batch_size, train.micro_batch_size, 0, ranks, 0)
    assert sum(len(mb) for mb in sampler.next_step()) * ranks == train.global_batch_size


def test_attention_dropout_outside_zero_one_is_rejected():
    with pytest.raises(ConfigError, match=r"model.attention_dropout must be in \[0, 1\), got 1.5"):
        to_config(compose_sft(["model.attention_dropout=1.5"]))
