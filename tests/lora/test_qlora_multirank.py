"""QLoRA under FSDP2 on 2 gloo ranks, from an HF checkpoint quantized at load.

Rank 0 reads and quantizes the checkpoint; rank 1 builds the structure on the meta device
and receives the 4-bit codes and scales from rank 0 (every rank holds the whole 4-bit base:
FSDP2 shards only the parameters, adapters and biases). Both ranks hold bitwise the codes a
single process quantizes; the 2-rank run resumes bitwise from an adapters-only checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.ckpt_state import build_trainer, load_with, save_with
from tests.checkpoint.helpers.ckpt_io import differences, read_checkpoint
from tests.distributed.spawn import run_ranks
from tests.lora.qlora_helpers import from_path, nf4_layers, save_hf_base
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.config.schema import ModelConfig
from veoptim.models import build_model
from veoptim.optim import MASTER_WEIGHT

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def _codes(model: torch.nn.Module) -> dict[str, str]:
    """A SHA-256 per layer of its codes and scales."""
    out = {}
    for name, layer in nf4_layers(model).items():
        name = name.replace(".base_layer", "")
        data = torch.cat([layer.nf4_codes.view(torch.uint8), layer.nf4_absmax.view(torch.uint8)])
        out[name] = hashlib.sha256(bytes(data.cpu().numpy())).hexdigest()
    return out


def _ranks(ctx, out: Path, base: str) -> dict:
    overrides = [*from_path(Path(base)), "parallel=fsdp"]
    straight = build_trainer(out / "straight", overrides, ctx)
    codes = _codes(straight.model)
    sharded = {n: type(p).__name__ for n, p in straight.model.named_parameters() if ".lora_A." in n}
    for _ in range(4):
        straight.train_step()
    first = build_trainer(out / "first", overrides, ctx)
    first.train_step()
    first.train_step()
    save_with(Checkpointer(out / "ckpt", fsync=False), first, "s2")
    resumed = build_trainer(out / "resumed", overrides, ctx)
    load_with(Checkpointer(out / "ckpt", fsync=False), resumed, "s2")
    resumed.train_step()
    resumed.train_step()
    for trainer, name in ((straight, "straight"), (resumed, "resumed")):
        save_with(Checkpointer(out / "ckpt", fsync=False), trainer, name)
    codes_after = _codes(resumed.model)
    record = {"codes": codes, "codes_after": codes_after, "adapter_types": sharded}
    (out / f"codes.rank{ctx.rank}.json").write_text(json.dumps(record))
    return record


def test_qlora_on_two_fsdp2_ranks_quantizes_at_load_and_resumes_bitwise(tmp_path):
    base = save_hf_base(tmp_path / "hf_base")
    run_ranks(2, _ranks, tmp_path / "run", str(base))
    single = build_model(ModelConfig(path=str(base), dtype="bf16", quant="nf4"), 0)
    expected = _codes(single)
    for rank in (0, 1):  # rank 1 got rank 0's codes; neither changed while training
        record = json.loads((tmp_path / "run" / f"codes.rank{rank}.json").read_text())
        assert record["codes"] == expected == record["codes_after"]
        assert record["adapter_types"] and set(record["adapter_types"].values()) == {"DTensor"}
    a = read_checkpoint(tmp_path / "run" / "ckpt" / "straight")
    b = read_checkpoint(tmp_path / "run" / "ckpt" / "resumed")
    assert any(k.endswith(MASTER_WEIGHT) for k in a.tensors)
    model_keys = [k for k in a.tensors if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert differences(a, b) == []
