"""Resharding: checkpoints written on 4 (and 2) gloo ranks loaded on other world sizes.

Loads run in fresh processes of the resume campaign (``helpers/resume_campaign.py``):
the real Checkpointer loads a step-N checkpoint into a trainer of another layout and,
when that succeeds, saves the loaded state again; both are read back into full
tensors. Layout rules: model weights reshard to any layout; dense FSDP optimizer
state reshards across world sizes; optimizer state across another expert-parallel
layout is rejected and leaves the live state bitwise unchanged.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.helpers import ckpt_io
from tests.checkpoint.helpers.resume_campaign import campaign, reshard_out, reshard_source
from tests.checkpoint.helpers.sft_jobs import RELOADED

pytestmark = pytest.mark.multirank

FULL_LOADS = ["dense_4to2", "dense_4to1", "dense_2to1", "dense_2to4", "moe_4to2_same_ep"]
WEIGHTS_ONLY = ["moe_4to2_no_ep_weights", "moe_4to1_weights"]
REJECTED = ["moe_4to2_no_ep_optimizer", "moe_4to1_optimizer"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / "resume_campaign"
    campaign(path)
    return path


def _reloaded(base: Path, key: str) -> tuple[ckpt_io.Snapshot, ckpt_io.Snapshot]:
    result = campaign(base)["loads"][key]
    assert result["error"] is None, result
    source = ckpt_io.read_checkpoint(reshard_source(base, key))
    return source, ckpt_io.read_checkpoint(reshard_out(base, key) / RELOADED)


@pytest.mark.parametrize("key", FULL_LOADS)
def test_model_and_optimizer_state_reshard_bitwise(base, key):
    source, reloaded = _reloaded(base, key)
    assert ckpt_io.master_keys(source)
    # RNG states are per rank and are restored only on the same world size
    assert ckpt_io.differences(source, reloaded, rng=False) == []
    # ... and installed by copying into the live shards, not through DCP's set_*_state_dict
    assert campaign(base)["loads"][key]["dcp_installs"] == []


@pytest.mark.parametrize("key", WEIGHTS_ONLY)
def test_moe_weights_load_on_another_ep_layout(base, key):
    source, reloaded = _reloaded(base, key)
    model = sorted(k for k in source.tensors if k.startswith("model."))
    assert any(".experts." in k for k in model)
    assert sorted(k for k in reloaded.tensors if k.startswith("model.")) == model
    for k in model:
        assert torch_equal(source.tensors[k], reloaded.tensors[k]), k
    assert reloaded.trainer_state["progress"]["global_step"] == 0  # weights only


@pytest.mark.parametrize("key", REJECTED)
def test_moe_optimizer_state_on_another_ep_layout_is_rejected(base, key):
    result = campaign(base)["loads"][key]
    error = result["error"]
    assert error is not None and "expert-parallel size differs (saved ep=2, live ep=1)" in error
    assert "checkpoint.load_optimizer=false" in error
    assert result["unchanged"] is True  # live model and optimizer bitwise unchanged
    assert not (reshard_out(base, key) / RELOADED).exists()


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
