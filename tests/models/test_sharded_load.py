"""model.path on several ranks: each rank reads only its shards from the safetensors files,
bitwise what rank 0 loading the whole model and broadcasting gives (dense FSDP, MoE with
expert parallel, BF16 from FP32 files, tied embeddings), with no rank materialising the
full model; files whose keys need conversion fall back to rank 0."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed.spawn import run_ranks
from tests.distributed.workers import VOCAB, model_config
from tests.distributed.workers_sharded_load import load_both_ways
from veoptim.models import build_model
from veoptim.models.sharded_load import SafetensorsShards, local_view, parameters_on_meta

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A dense model with tied embeddings (FP32 files, one file) and a MoE (sharded index)."""
    root = tmp_path_factory.mktemp("models")
    dense_cfg = model_config(False)
    dense_cfg.tie_word_embeddings = True
    dense = build_model(dense_cfg, VOCAB)
    dense.save_pretrained(root / "dense")
    moe = build_model(model_config(True), VOCAB).to(torch.bfloat16)
    moe.save_pretrained(root / "moe", max_shard_size="100KB")
    # The same dense weights, one tensor renamed: keys that need conversion.
    renamed = root / "renamed"
    dense.save_pretrained(renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.norm.scale"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    return {name: str(root / name) for name in ("dense", "moe", "renamed")}


def cases(dirs: dict[str, str], world: int) -> dict[str, dict]:
    experts = model_config(True).num_experts
    out = {
        "dense_fp32": {"path": dirs["dense"], "dtype": "fp32", "num_experts": 0,
                       "parallel": {}},
        "dense_bf16": {"path": dirs["dense"], "dtype": "bf16", "num_experts": 0,
                       "parallel": {}},
        "moe_bf16": {"path": dirs["moe"], "dtype": "bf16", "num_experts": experts,
                     "parallel": {}},
        "moe_ep2": {"path": dirs["moe"], "dtype": "bf16", "num_experts": experts,
                    "parallel": {"ep": 2}},
        "renamed": {"path": dirs["renamed"], "dtype": "fp32", "num_experts": 0,
                    "parallel": {}},
    }  # fmt: skip
    if world == 4:
        out["hsdp"] = {"path": dirs["dense"], "dtype": "bf16", "num_experts": 0,
                       "parallel": {"dp_replicate": 2}}  # fmt: skip
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_its_shards_bitwise(model_dirs, tmp_path, world):
    results = run_ranks(world, load_both_ways, tmp_path, cases(model_dirs, world))
    for name, r in results.items():
        assert r["same_keys"], name
        assert r["mismatched"] == [] and r["mismatched_buffers"] == [], (name, r)
        assert r["used_files"] == (name != "renamed"), name
    assert results["dense_bf16"]["dtypes"] == ["torch.bfloat16"]
    assert results["dense_fp32"]["dtypes"] == ["torch.float32"]


def test_parameters_on_meta_keeps_buffers():
    with parameters_on_meta():
        model = build_model(model_config(False), VOCAB)
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert buffers and not any(b.is_meta for b in buffers.values())
    reference = dict(build_model(model_config(False), VOCAB).named_buffers())
    assert all(torch.equal(buffers[k], reference[k]) for k in reference)


def test_index_errors_and_absent_files(tmp_path):
    assert SafetensorsShards.open(tmp_path) is None
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(Exception, match="weight_map"):
        SafetensorsShards.open(tmp_path)


def test_local_view_of_a_plain_tensor_is_the_whole():
    t = torch.arange(6.0).reshape(2, 3)
    local, index = local_view(t)
    assert local is t and torch.equal(t[index], t)
